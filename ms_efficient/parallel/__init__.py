"""Running the plans on an Ascend cluster: :func:`parallelize` (MindSpore 2.10's
``AutoParallel`` set up from the plans; ``wrapper``), the settings it derives and checks
(``settings``, no MindSpore) and the launch bundle (``bundle``: strategy file, MindFormers-style
YAML, msrun script). MindSpore is imported only when :func:`parallelize` is called."""
from ms_efficient.parallel.settings import ParallelSettings, settings_from_plans
from ms_efficient.parallel.wrapper import parallelize

__all__ = ["parallelize", "ParallelSettings", "settings_from_plans"]
