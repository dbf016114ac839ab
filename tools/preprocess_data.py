"""Source-checkout wrapper of ``epas-preprocess``: ``python tools/preprocess_data.py --help``."""
import sys

from epas_megatron.data.preprocess import main

if __name__ == "__main__":  # guarded: --workers spawns processes that re-import this file
    sys.exit(main())
