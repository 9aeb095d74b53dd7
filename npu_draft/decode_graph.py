"""One-token draft steps through fixed buffers, replayed as CUDA graphs on CUDA.

A draft step of the 0.6B-shape drafter is ~600 small kernels. On an H100 through ONNX
Runtime's CUDA provider it took 2.9 ms a step bare and 3.7-5.2 ms through the runner,
while the GPU's own work is well under a millisecond (`scripts/drafter_profile.py`,
docs/BENCHMARKS.md): the step is bound by launching kernels, one Python-and-ORT call
per node. A captured CUDA graph launches them all at once.

A captured graph reads and writes the addresses it saw, so every input and output of a
step lives in a buffer of its own that never moves: the token, its position, the
attention mask at the full context (GroupQueryAttention takes the cached length from
the mask's sum and the buffer's length from its shape, so zeros past the tokens are
ignored, as in onnxruntime-genai's static-mask decoding), and the logits. The KV cache
buffers are the slot's (`npu_draft.kv_slots`). Each step copies the token, position
and mask in, replays, and copies the logits out.

ONNX Runtime keeps captured graphs per thread and per `gpu_graph_id` (a run option), for
the session's life. It captures after a few plain runs of an id. Runs with id -1 (prompt
chunks, whose shapes vary) are never captured. On the CPU the same steps run uncaptured:
the tests' way to check the fixed-buffer path against the dynamic one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnxruntime as ort

GRAPH_ID_OPTION = "gpu_graph_id"


def run_options(graph_id: int) -> ort.RunOptions:
    """Run options naming the CUDA graph a run captures or replays (-1: none)."""
    options = ort.RunOptions()
    options.add_run_config_entry(GRAPH_ID_OPTION, str(graph_id))
    return options


class DecodeGraph:
    """One slot's one-token step: fixed input and output buffers, one graph id."""

    def __init__(
        self,
        session: ort.InferenceSession,
        bind_cache: Callable[[ort.IOBinding], None],
        *,
        graph_id: int,
        device: str,
        max_context: int,
        vocab_size: int,
        logits_dtype: type,
        has_position_ids: bool,
    ) -> None:
        def buffer(shape: tuple[int, ...], dtype: type) -> ort.OrtValue:
            if device == "cpu":
                return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype))
            return ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device, 0)

        self._session = session
        self.graph_id = graph_id
        self._options = run_options(graph_id)
        self._token = buffer((1, 1), np.int64)
        self._mask = buffer((1, max_context), np.int64)
        self._positions = buffer((1, 1), np.int64) if has_position_ids else None
        self._logits = buffer((1, 1, vocab_size), logits_dtype)
        self._host_mask = np.zeros((1, max_context), np.int64)
        self._binding = session.io_binding()
        bind_cache(self._binding)
        self._binding.bind_ortvalue_input("input_ids", self._token)
        self._binding.bind_ortvalue_input("attention_mask", self._mask)
        if self._positions is not None:
            self._binding.bind_ortvalue_input("position_ids", self._positions)
        self._binding.bind_ortvalue_output("logits", self._logits)

    def step(self, token: int, past_length: int) -> np.ndarray:
        """Logits after `token` at position `past_length` (the cache holds the ones before)."""
        total = past_length + 1
        self._token.update_inplace(np.array([[token]], np.int64))
        self._host_mask[0, :total] = 1
        self._host_mask[0, total:] = 0
        self._mask.update_inplace(self._host_mask)
        if self._positions is not None:
            self._positions.update_inplace(np.array([[past_length]], np.int64))
        self._session.run_with_iobinding(self._binding, self._options)
        return np.array(
            self._logits.numpy()[0, -1], dtype=np.float32
        )  # a copy: the buffer is reused
