"""Graph passes over exported step programs, and the manager that runs them.

Importing this package registers every pass module in this folder (one file per pass, each
with one `@register_pass` line), so a new pass needs no edit here.
"""
import importlib as _importlib
import pkgutil as _pkgutil

from dspark_compile.passes.base import (STAGES, PassConfig, PassContext, PassContractError, PassError,
                   PassNoMatchWarning, PassPipelineError, PassResult, PassVerificationError)
from dspark_compile.passes.registry import (REGISTRY, PassRegistry, PassSpec, isolated_registry, register_pass,
                       source_hash)
from dspark_compile.passes.manager import PassManager, format_stats_table, sync_output_signature

# Infrastructure modules; every other module in this folder is a pass file.
_INFRA = {"base", "registry", "manager", "verify", "graph_utils", "regions"}


def load_pass_modules() -> list[str]:
    """Import every pass module of this package (idempotent); returns their names."""
    names = []
    for info in _pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name in _INFRA:
            continue
        _importlib.import_module(f"{__name__}.{info.name}")
        names.append(info.name)
    return names


load_pass_modules()

from dspark_compile.passes.dce import eliminate_dead_code  # noqa: E402
from dspark_compile.passes.lint_host_sync import (  # noqa: E402
    HostSyncError, find_host_syncs, lint_host_sync)
from dspark_compile.passes.state_in_place import (  # noqa: E402
    WholeCacheCopyError, assert_no_whole_cache_copy, find_whole_cache_copies)

__all__ = [
    "STAGES", "PassConfig", "PassContext", "PassContractError", "PassError", "PassNoMatchWarning",
    "PassPipelineError", "PassResult", "PassVerificationError", "REGISTRY", "PassRegistry",
    "PassSpec", "isolated_registry", "register_pass", "source_hash", "PassManager",
    "format_stats_table", "sync_output_signature", "load_pass_modules", "eliminate_dead_code",
    "HostSyncError", "find_host_syncs", "lint_host_sync", "WholeCacheCopyError",
    "assert_no_whole_cache_copy", "find_whole_cache_copies",
]
