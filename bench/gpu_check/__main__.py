"""`python3 -m bench.gpu_check`: check the interpreter and libraries first (with a message that
says what is missing), then run. On CPU, Triton's kernels run in its interpreter: the variable
must be set before triton is first imported."""

import os
import sys

from bench.gpu_check.versions import check_versions, device_of

if __name__ == "__main__":
    device = device_of(sys.argv[1:])
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    check_versions(device)
    from bench.gpu_check.main import main

    sys.exit(main())
