"""DeepSeek-V4 target + DSpark draft reference models (imported as dspark_compile.models)."""
from dspark_compile.models.loading import load_model  # noqa: F401
