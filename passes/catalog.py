"""The public names of dspark_compile.passes, and the loading of its pass files.

Importing this module registers every pass module in the passes folder (one file per pass, each
with one `@register_pass` line), so a new pass needs no edit here.
"""
import importlib
import pkgutil
from pathlib import Path

from dspark_compile.passes.base import (STAGES, PassConfig, PassContext, PassContractError, PassError,
                   PassNoMatchWarning, PassPipelineError, PassResult, PassVerificationError)
from dspark_compile.passes.registry import (REGISTRY, PassRegistry, PassSpec, isolated_registry, register_pass,
                       source_hash)
from dspark_compile.passes.manager import PassManager, format_stats_table, sync_output_signature

PACKAGE = "dspark_compile.passes"
# Infrastructure modules; every other module in the folder is a pass file.
_INFRA = {"base", "registry", "manager", "verify", "graph_utils", "regions", "catalog"}


def load_pass_modules() -> list[str]:
    """Import every pass module of the package (idempotent), always under the package's own
    name; returns their names."""
    names = []
    for info in pkgutil.iter_modules([str(Path(__file__).resolve().parent)]):
        if info.name.startswith("_") or info.name in _INFRA:
            continue
        importlib.import_module(f"{PACKAGE}.{info.name}")
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
