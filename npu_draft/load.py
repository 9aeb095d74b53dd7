"""`load_drafter`: one entry point that picks the backend from what it is given.

Accepted forms::

    "ngram", "ngram:4,3,2"          model-free prompt lookup (n-gram sizes optional)
    FOLDER with genai_config.json   backend genai (unless backend="onnx", or
                                    onnxruntime-genai is not installed)
    FOLDER with model.onnx          backend onnx
    "FOLDER+ngram"                  the model, with n-gram continuations when long
    FOLDER with oracle.json only    the oracle stand-in for benchmarks (npu_draft.oracle)
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

from npu_draft.protocol import DraftModel
from npu_draft.tokenizer_check import TokenizerFacts, check_tokenizer_match, drafter_facts

BACKENDS = ("auto", "genai", "onnx", "ngram")
log = logging.getLogger(__name__)


def genai_installed() -> bool:
    return importlib.util.find_spec("onnxruntime_genai") is not None


def parse_ngram_spec(spec: str) -> tuple[int, ...] | None:
    """(sizes) for "ngram" / "ngram:4,3"; None when spec is not an n-gram spec."""
    name, _, sizes = spec.partition(":")
    if name != "ngram":
        return None
    if not sizes:
        return (3, 2)
    try:
        return tuple(int(size) for size in sizes.split(","))
    except ValueError:
        raise ValueError(f"bad n-gram sizes in {spec!r}; e.g. ngram:4,3,2") from None


def load_drafter(
    path_or_spec: str | Path,
    provider: str = "auto",
    *,
    backend: str = "auto",
    target: TokenizerFacts | None = None,
    ngram_sizes: tuple[int, ...] = (3, 2),
    min_ngram_tokens: int = 3,
    **opts: Any,
) -> DraftModel:
    """Load a drafter; with `target`, refuse one whose tokenizer does not match.

    `opts` go to the backend: max_context, cross_check, config_file, cache_dir,
    cache_key (VitisAI), threads.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown drafter backend {backend!r}; one of {', '.join(BACKENDS)}")
    text = str(path_or_spec)
    sizes = parse_ngram_spec(text)
    if sizes is not None or backend == "ngram":
        from npu_draft.ngram import NgramDraftModel

        return NgramDraftModel(sizes or ngram_sizes)
    if text.endswith("+ngram"):
        from npu_draft.ngram import CombinedDraftModel

        inner = load_drafter(
            text[: -len("+ngram")], provider, backend=backend, target=target, **opts
        )
        return CombinedDraftModel(inner, ngram_sizes, min_ngram_tokens)
    return _load_folder(text, provider, backend, target, opts)


def _load_folder(
    text: str, provider: str, backend: str, target: TokenizerFacts | None, opts: dict[str, Any]
) -> DraftModel:
    """A drafter folder: a model for the genai or onnx backend, or, in a folder that
    holds none, the benchmarks' oracle stand-in."""
    folder = Path(text)
    if not folder.is_dir():
        raise FileNotFoundError(f"drafter {text!r} is neither a folder nor 'ngram[:sizes]'")
    if not _holds_model(folder):
        from npu_draft.oracle import is_oracle_folder

        if is_oracle_folder(folder):
            return _load_oracle(folder, target)
    if target is not None:
        _require_matching_tokenizer(folder, target)
    if _folder_backend(folder, backend) == "genai":
        from npu_draft.genai import GenaiDraftModel

        return GenaiDraftModel(folder, provider, **opts)
    from npu_draft.onnx_runner import OnnxDraftModel

    return OnnxDraftModel(folder, provider, **opts)


def _load_oracle(folder: Path, target: TokenizerFacts | None) -> DraftModel:
    from npu_draft.oracle import OracleDraftModel

    oracle = OracleDraftModel.from_folder(folder)
    if target is not None:  # it records no tokenizer, only the vocabulary size
        check_tokenizer_match(TokenizerFacts(oracle.info.name, oracle.info.vocab_size), target)
    return oracle


def _require_matching_tokenizer(folder: Path, target: TokenizerFacts) -> None:
    expected = drafter_facts(folder)
    if expected is None:
        raise ValueError(
            f"{folder} does not record which tokenizer it expects (no npu_draft.json or "
            f"config.json); re-export it with `npu-spec export-drafter`"
        )
    check_tokenizer_match(expected, target)


def _holds_model(folder: Path) -> bool:
    return (folder / "genai_config.json").is_file() or any(folder.glob("*.onnx"))


def _folder_backend(folder: Path, backend: str) -> str:
    """`backend`, or with "auto" the one the folder's files call for."""
    if backend != "auto":
        return backend
    has_graph = any(folder.glob("*.onnx"))
    if (folder / "genai_config.json").is_file():
        if has_graph and not genai_installed():
            # the onnx backend runs the same graph with onnxruntime alone (a GPU host's
            # onnxruntime-gpu often comes without onnxruntime-genai)
            log.info("%s: onnxruntime-genai is not installed; using the onnx backend", folder)
            return "onnx"
        return "genai"
    if has_graph:
        return "onnx"
    raise FileNotFoundError(
        f"{folder} holds neither genai_config.json nor an .onnx model; "
        f"export one with `npu-spec export-drafter HF_DIR {folder}`"
    )
