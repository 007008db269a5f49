import os
import tempfile

import torch

torch.set_num_threads(int(os.environ.get("SELFSPEC_TEST_THREADS", "1")))
# Cost tables measured by the tests stay out of the user's cache.
os.environ.setdefault("SELFSPEC_COSTS_CACHE", tempfile.mkdtemp(prefix="selfspec-test-costs-"))
