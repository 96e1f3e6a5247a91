"""Check that every plan took effect in the compiled graph (a MindSpore FULL_GRAPH custom pass,
``kernels/cpu/verify_pass.cc``, built on first use and cached). See ``check`` for what is
checked, ``plugin`` for the build and ``record`` for the record format."""
from ms_efficient.verify.check import PlanNotRealised, check_plans, compile_record, verify_plans
from ms_efficient.verify.plugin import (RECORD_ENV, VerifyUnavailable, build_plugin,
                                        ensure_registered, verify_available)
from ms_efficient.verify.record import CompiledRecord, RecordedNode

__all__ = ["PlanNotRealised", "VerifyUnavailable", "RECORD_ENV", "CompiledRecord", "RecordedNode",
           "build_plugin", "ensure_registered", "verify_available", "compile_record",
           "check_plans", "verify_plans"]
