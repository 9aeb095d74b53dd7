"""Offline model factory: random-weight Qwen3 targets and drafts with the real vocabulary."""

from npu_draft.factory.make import DraftSpec, make_models, write_target
from npu_draft.factory.shapes import CORE, DRAFT_SHAPES, TARGET_SHAPES, ModelShape

__all__ = [
    "CORE",
    "DRAFT_SHAPES",
    "TARGET_SHAPES",
    "DraftSpec",
    "ModelShape",
    "make_models",
    "write_target",
]
