"""The two manifest fields a runnable engine needs beyond what the artifact checks:
`model_config` (the checkpoint's config.json) and `build_config` (BuildConfig.to_manifest()).

An engine missing either, or holding one that does not parse, is refused with an ArtifactError
naming the field, before anything is allocated; read by the runtime and by `dspark-compile
run` (which checks the requests against them before loading the programs)."""
from __future__ import annotations

import dataclasses

from dspark_compile.artifact import ArtifactError

def engine_configs(manifest: dict):
    """(ModelConfig, BuildConfig) of a validated manifest."""
    from dspark_compile.build_config import NOT_RECORDED, BuildConfig
    from dspark_compile.models.config import ConfigError, ModelConfig

    for field in ("model_config", "build_config"):
        if field not in manifest:
            raise ArtifactError(f"manifest field '{field}' is missing (not an engine that "
                                "`dspark-compile build` wrote) — rebuild", field=field)
        if not isinstance(manifest[field], dict):
            raise ArtifactError(f"manifest field '{field}' is a {type(manifest[field]).__name__}, "
                                "not a table — rebuild", field=field)
    try:
        cfg = ModelConfig.from_dict(manifest["model_config"])
    except ConfigError as e:
        raise ArtifactError(f"manifest field 'model_config': {e}", field="model_config") from None
    bc = dict(manifest["build_config"])
    # engines written before the field existed ran their exported programs op by op
    bc.setdefault("backend", "aten")
    # engines written before prefill_chunks existed prefill with the eager reference
    bc.setdefault("prefill_chunks", ())
    want = [f.name for f in dataclasses.fields(BuildConfig) if f.name not in NOT_RECORDED]
    missing = [k for k in want if k not in bc]
    unknown = sorted(set(bc) - set(want))
    if missing or unknown:
        what = (f"lacks {missing}" if missing else "") + (" and " if missing and unknown else "") \
            + (f"has unknown {unknown}" if unknown else "")
        raise ArtifactError(f"manifest field 'build_config' {what} — rebuild",
                            field=f"build_config.{(missing or unknown)[0]}")
    bc["buckets"] = tuple(bc["buckets"]) if isinstance(bc["buckets"], list) else bc["buckets"]
    try:
        build = BuildConfig(**bc)
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"manifest field 'build_config': {e}", field="build_config") from None
    if not cfg.has_draft:
        raise ArtifactError("manifest field 'model_config': no DSpark draft (dspark_block_size)",
                            field="model_config")
    return cfg, build
