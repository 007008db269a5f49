import os

import torch

torch.set_num_threads(int(os.environ.get("SELFSPEC_TEST_THREADS", "1")))
