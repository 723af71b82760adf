"""The parameter record lives in the package (`python/smp_partition/param_record.py`, shipped
in the wheel); this shim lets scripts/ and tests/ import it as `param_record` without
installing the package."""

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "python" / "smp_partition" / "param_record.py"
_spec = importlib.util.spec_from_file_location("smp_partition_param_record", _PATH)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("smp_partition_param_record", _module)
_spec.loader.exec_module(_module)
globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
