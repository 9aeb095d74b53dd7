"""One draft step for B token sequences in one ONNX Runtime run (issue 29, item 3).

Multi-outcome drafting drafts several candidate lines at once (the all-accepted line,
and after the likeliest rejections the line that starts at the draft's runner-up). The
drafter graphs this project writes (`npu_draft.onnx_writer`, and the model builder's,
which it copies) have a dynamic batch axis `batch_size`, and GroupQueryAttention reads
each row's own length from its attention-mask row, so the rows of one batch may hold
contexts of different lengths. `BatchStep` binds one shared past/present buffer per
layer shaped [B, kv_heads, capacity, head_dim], as `onnx_runner` does for B = 1, and
runs one new token per row.

`random_drafter` writes the graph of a named draft shape (the real Qwen3-0.6B shape by
default) with random weights, so the cost of a step can be measured with no checkpoint
and no download; `to_float16` turns it into an fp16 graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from npu_draft.factory.hf_out import hf_config
from npu_draft.factory.shapes import ModelShape
from npu_draft.factory.weights import random_weights
from npu_draft.onnx_writer import MODEL_FILE, Qwen3Config, build_model, save_graph, to_float16

_ORT_FLOAT = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def random_drafter(
    shape: ModelShape, out_dir: Path, context: int, seed: int = 0, float16: bool = False
) -> Path:
    """Write `out_dir/model.onnx` (external data beside it): a drafter graph of this shape
    with random weights (the factory's, with a separate output head as the factory's
    padded drafts have). Returns the model path."""
    raw = hf_config(shape) | {"max_position_embeddings": context}
    model = build_model(Qwen3Config(raw), random_weights(shape, seed), context)
    if float16:
        model = to_float16(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_graph(model, out_dir)
    return out_dir / MODEL_FILE


def batch_axis(session: ort.InferenceSession) -> int | None:
    """The fixed batch size of the graph's `input_ids`, or None when the axis is dynamic."""
    dim = next(i for i in session.get_inputs() if i.name == "input_ids").shape[0]
    return dim if isinstance(dim, int) else None


class BatchStep:
    """B rows of KV cache in shared past/present buffers, one new token per row per run."""

    def __init__(
        self, session: ort.InferenceSession, batch: int, capacity: int, device: str = "cpu"
    ) -> None:
        self.session, self.batch, self.capacity = session, batch, capacity
        inputs = {i.name: i for i in session.get_inputs()}
        self._has_position_ids = "position_ids" in inputs
        self.binding = session.io_binding()
        self.buffers: dict[str, ort.OrtValue] = {}
        for name, meta in inputs.items():
            if not name.startswith("past_key_values."):
                continue
            _, kv_heads, _, head_dim = meta.shape
            shape = (batch, kv_heads, capacity, head_dim)
            dtype = _ORT_FLOAT[meta.type]
            # zeros, on the device the provider computes on (see onnx_runner)
            value = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype), device, 0)
            self.buffers[name] = value
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output(name.replace("past_key_values.", "present."), value)

    def fill(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace cached keys/values (CPU buffers only): name -> [B, kv, capacity, hd]."""
        for name, array in arrays.items():
            self.buffers[name].numpy()[...] = array

    def step(self, tokens: Sequence[int], lengths: Sequence[int]) -> np.ndarray:
        """Row b appends tokens[b] after lengths[b] cached positions; logits [B, vocab]."""
        assert len(tokens) == len(lengths) == self.batch
        width = max(lengths) + 1
        assert width <= self.capacity, f"{width} positions do not fit in {self.capacity}"
        mask = np.zeros((self.batch, width), np.int64)
        for row, length in enumerate(lengths):
            mask[row, : length + 1] = 1
        binding = self.binding
        binding.bind_cpu_input("input_ids", np.asarray(tokens, np.int64).reshape(-1, 1))
        binding.bind_cpu_input("attention_mask", mask)
        if self._has_position_ids:
            binding.bind_cpu_input("position_ids", np.asarray(lengths, np.int64).reshape(-1, 1))
        binding.bind_output("logits", "cpu")
        self.session.run_with_iobinding(binding)
        logits = binding.get_outputs()[-1].numpy()
        return np.asarray(logits[:, -1], dtype=np.float32)

    def run_again(self) -> None:
        """Repeat the last step as bound (timing: the cache positions are rewritten in place)."""
        self.session.run_with_iobinding(self.binding)
