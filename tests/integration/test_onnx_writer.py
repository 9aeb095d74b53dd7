"""The PyTorch-free drafter writer (`npu_draft.onnx_writer`) and tokenizer conversion
(`npu_draft.gguf_tokenizer`): their output equals the Hugging Face reference and the
files transformers and the model builder write, and `make_models` runs without PyTorch."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

from npu_draft.export import ExportError, export_drafter
from npu_draft.load import load_drafter
from npu_draft.onnx_writer import float16_copy, write_drafter
from npu_draft.tokenizer_check import PROBE_TEXT, DrafterManifest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
VOCAB = 4096
# Runs first in a child interpreter: every import finder answers "no such module" for
# torch, as in a virtual environment without it (transformers then runs without it too).
NO_TORCH = textwrap.dedent(
    """
    import sys

    class NoTorch:
        def __init__(self, inner):
            self.inner = inner

        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                return None
            find = getattr(self.inner, "find_spec", None)
            return find(name, path, target) if find else None

        def __getattr__(self, attribute):
            return getattr(self.inner, attribute)

    sys.meta_path[:] = [NoTorch(finder) for finder in sys.meta_path]
    """
)


def run_without_torch(code: str, timeout: int = 300) -> str:
    script = NO_TORCH + textwrap.dedent(code) + "\nassert 'torch' not in sys.modules\n"
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def tiny_checkpoint(folder: Path, tied: bool, dtype) -> Path:
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=50_000.0,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(1 if tied else 0)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # wide weights (and norms away from 1), so errors show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0, 1.0 if "embed" in name else 0.15)
    model.to(dtype).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["separate-head-f32", "tied-head-bf16"])
def checkpoint(request, tmp_path_factory) -> Path:
    tied = request.param.startswith("tied")
    folder = tmp_path_factory.mktemp("ckpt") / request.param
    return tiny_checkpoint(folder, tied, torch.bfloat16 if tied else torch.float32)


@pytest.fixture(scope="module")
def written(checkpoint: Path, tmp_path_factory) -> Path:
    return write_drafter(checkpoint, tmp_path_factory.mktemp("out") / "drafter", max_context=256)


def reference_logits(checkpoint: Path, tokens: list[int]) -> np.ndarray:
    """Hugging Face's logits at every position (float32, bfloat16 weights widened)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("backend", ["onnx", "genai"])
def test_logits_equal_hugging_face_over_prompt_decode_and_rollback(
    checkpoint: Path, written: Path, backend: str
) -> None:
    rng = np.random.default_rng(7)
    prompt = rng.integers(3, VOCAB, 11).tolist()
    session = load_drafter(written, "cpu", backend=backend, max_context=64).open_session()
    session.sync(prompt)
    sequence, seen = list(prompt), []
    for _ in range(6):  # decode steps: each appends one token to the cache
        seen.append(session.next_logits().copy())
        sequence.append(int(np.argmax(seen[-1])))
        assert session.sync(sequence).appended == 1
    seen.append(session.next_logits().copy())
    full = reference_logits(checkpoint, sequence)
    np.testing.assert_allclose(np.stack(seen), full[len(prompt) - 1 :], rtol=1e-4, atol=1e-4)
    assert [int(np.argmax(x)) for x in seen[:-1]] == sequence[len(prompt) :]

    # roll back three tokens and take another branch: the cache past them must not leak
    branch = [*sequence[:-3], int(rng.integers(3, VOCAB)), int(rng.integers(3, VOCAB))]
    session.sync(branch)
    expected = reference_logits(checkpoint, branch)[-1]
    np.testing.assert_allclose(session.next_logits(), expected, rtol=1e-4, atol=1e-4)


def test_the_graph_is_the_model_builders(tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint(tmp_path / "ckpt", tied=False, dtype=torch.float32)
    ours = write_drafter(checkpoint, tmp_path / "ours", max_context=512)
    builder = export_drafter(checkpoint, tmp_path / "builder", max_context=512)

    def op_counts(folder: Path) -> collections.Counter:
        graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
        return collections.Counter(
            (node.op_type, node.domain) for node in graph.node if node.op_type != "Constant"
        )

    def io(folder: Path) -> tuple[list[str], list[str]]:
        graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
        return sorted(i.name for i in graph.input), sorted(o.name for o in graph.output)

    assert op_counts(ours) == op_counts(builder)
    assert io(ours) == io(builder)
    configs = [json.loads((f / "genai_config.json").read_text()) for f in (ours, builder)]
    for config in configs:
        config["model"].pop("pad_token_id")  # unused by a single-sequence drafter
    assert configs[0] == configs[1]
    manifests = [DrafterManifest.read(f) for f in (ours, builder)]
    assert manifests[0] == manifests[1]


def test_writing_is_deterministic_and_explains_what_it_refuses(
    checkpoint: Path, written: Path, tmp_path: Path
) -> None:
    again = write_drafter(checkpoint, tmp_path / "again", max_context=256)
    names = sorted(p.name for p in written.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (written / name).read_bytes() == (again / name).read_bytes(), name
    with pytest.raises(ExportError, match="not empty"):
        write_drafter(checkpoint, again, overwrite=False)
    with pytest.raises(ValueError, match="unknown format"):
        write_drafter(checkpoint, tmp_path / "x", fmt="gguf")
    with pytest.raises(ExportError, match="not a Hugging Face checkpoint"):
        write_drafter(tmp_path, tmp_path / "x")
    config = json.loads((checkpoint / "config.json").read_text())
    for change, message in (
        ({"model_type": "llama"}, "knows Qwen3 only"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
    ):
        folder = tmp_path / f"bad-{len(message)}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ExportError, match=message):
            write_drafter(folder, tmp_path / "x")


def test_onnx_format_drops_genai_config(checkpoint: Path, tmp_path: Path) -> None:
    folder = write_drafter(checkpoint, tmp_path / "onnx", fmt="onnx", max_context=128)
    assert not (folder / "genai_config.json").exists()
    manifest = DrafterManifest.read(folder)
    assert manifest is not None and manifest.format == "onnx"
    assert manifest.decoder["context_length"] == 128


@pytest.mark.slow
def test_tokenizer_files_are_the_ones_transformers_writes(tmp_path: Path) -> None:
    from npu_draft.factory.make import _pinned_sources

    vocab_gguf, template = _pinned_sources()
    run_without_torch(
        f"""
        from pathlib import Path
        from npu_draft.factory.hf_out import build_tokenizer_files
        out = Path({str(tmp_path / "ours")!r})
        build_tokenizer_files(Path({str(vocab_gguf)!r}), {template!r}, out)
        """
    )
    reference = transformers.AutoTokenizer.from_pretrained(
        str(vocab_gguf.parent), gguf_file=vocab_gguf.name
    )
    reference.eos_token, reference.pad_token = "<|im_end|>", "<|endoftext|>"
    reference.chat_template = template
    reference.save_pretrained(str(tmp_path / "reference"))
    ours, theirs = tmp_path / "ours", tmp_path / "reference"
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    config = json.loads((theirs / "tokenizer_config.json").read_text())
    for loading_detail in ("is_local", "local_files_only"):
        config.pop(loading_detail)
    assert json.loads((ours / "tokenizer_config.json").read_text()) == config
    assert (ours / "gguf-tokenizer-fields.json").is_file()  # make_models' cache
    loaded = transformers.AutoTokenizer.from_pretrained(str(ours))
    assert loaded(PROBE_TEXT).input_ids == reference(PROBE_TEXT).input_ids
    assert loaded.eos_token_id == 151_645


@pytest.mark.slow
def test_make_models_runs_without_torch_and_its_drafter_equals_hugging_face(
    tmp_path: Path,
) -> None:
    out = tmp_path / "models"
    run_without_torch(
        f"""
        from npu_draft.factory import make_models
        make_models({str(out)!r}, draft="noisy")
        """
    )
    manifest = DrafterManifest.read(out / "draft")
    assert manifest is not None and manifest.format == "genai"
    assert manifest.decoder["context_length"] == 8192
    prompt = np.random.default_rng(3).integers(3, 151_000, 30).tolist()
    for backend in ("genai", "onnx"):
        session = load_drafter(out / "draft", "cpu", backend=backend, max_context=128)
        session = session.open_session()
        session.sync(prompt)
        draft = session.propose(8)
        full = reference_logits(out / "draft-hf", prompt + draft.tokens)
        assert draft.tokens == full[len(prompt) - 1 : -1].argmax(-1).tolist(), backend
        np.testing.assert_allclose(session.next_logits(), full[-1], rtol=1e-4, atol=1e-4)


def test_export_drafter_without_torch_writes_fp32_and_explains_int4(tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint(tmp_path / "ckpt", tied=False, dtype=torch.float32)
    out = run_without_torch(
        f"""
        from npu_draft.export import ExportError, export_drafter
        export_drafter({str(checkpoint)!r}, {str(tmp_path / "fp32")!r}, fmt="onnx")
        try:
            export_drafter({str(checkpoint)!r}, {str(tmp_path / "int4")!r}, precision="int4")
        except ExportError as error:
            print(error)
        """
    )
    assert "needs torch" in out and "npu-spec[export]" in out
    assert not (tmp_path / "int4").exists()
    expected = write_drafter(checkpoint, tmp_path / "direct", fmt="onnx")
    for name in ("model.onnx", "model.onnx.data", "npu_draft.json"):
        assert (tmp_path / "fp32" / name).read_bytes() == (expected / name).read_bytes(), name


def test_fp16_export_is_the_fp32_graph_in_half_precision(tmp_path: Path) -> None:
    # for the CUDA provider, whose GroupQueryAttention takes no fp32; written by the writer
    # even where the builder could run, and the same as converting an fp32 folder
    checkpoint = tiny_checkpoint(tmp_path / "ckpt", tied=False, dtype=torch.float32)
    half = export_drafter(checkpoint, tmp_path / "fp16", fmt="onnx", precision="fp16")
    manifest = DrafterManifest.read(half)
    assert manifest is not None and manifest.precision == "fp16"
    graph = onnx.load(str(half / "model.onnx"), load_external_data=False).graph
    past = next(i for i in graph.input if i.name == "past_key_values.0.key")
    assert past.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    converted = float16_copy(write_drafter(checkpoint, tmp_path / "fp32", fmt="onnx"),
                             tmp_path / "converted")  # fmt: skip
    for name in ("model.onnx", "model.onnx.data", "npu_draft.json"):
        assert (half / name).read_bytes() == (converted / name).read_bytes(), name
    prompt = np.random.default_rng(5).integers(3, 1000, 12).tolist()
    session = load_drafter(half, "cpu", max_context=64).open_session()
    session.sync(prompt)
    full = reference_logits(checkpoint, prompt)
    np.testing.assert_allclose(session.next_logits(), full[-1], rtol=2e-2, atol=2e-2)
