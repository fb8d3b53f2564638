"""The 0.1 home of the manager, its state helpers and the timeouts, kept until 0.3 so old imports still work.

``lightning_fthsdp.core.manager`` is now ``lightning_fthsdp.manager``, ``core.torch_state`` is
``lightning_fthsdp.recovery.torch_state`` and ``core.config`` is ``lightning_fthsdp.config`` (``timeouts`` and
``env``).
"""

import warnings

warnings.warn("lightning_fthsdp.core is deprecated (the old name goes in 0.3): import FTManager from "
              "lightning_fthsdp.manager, ModuleState and friends from lightning_fthsdp.recovery.torch_state, "
              "Timeouts from lightning_fthsdp.config.timeouts", FutureWarning, stacklevel=2)
