"""The proxy's own Prometheus metrics (text exposition format, no dependency): the
engine's rounds (`ProxyMetrics`), what the policies measured and chose (`policy_page`)
and the fault paths (`reliability_page`); `/metrics` serves them in that order."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.data.records import RoundRecord
from proxy.policies import SharedPolicies

MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
TPS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            running += count
            lines.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        lines.append(f"{name}_sum {self.total:.6g}")
        lines.append(f"{name}_count {self.n}")
        return lines


class ProxyMetrics:
    """Round and request statistics; the engine reports into it (RoundObserver)."""

    def __init__(self) -> None:
        self.rounds = 0
        self.empty_draft_rounds = 0  # verify rounds the drafter proposed nothing for
        self.runner_up_line_rounds = 0  # verify rounds whose draft a runner-up line held
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.reused_tokens = 0  # drafts that were ready from drafting ahead
        self.generated_tokens = 0
        self.accepted_per_position: Counter[int] = Counter()
        self.drafted_per_position: Counter[int] = Counter()
        self.requests: Counter[str] = Counter()  # by path taken: speculative / passthrough
        self.drafter_failures = 0
        # sampling mode: what the Leviathan/Chen rule kept vs a match-only rule on the
        # same drafts (accept while draft == the server's own sampled token)
        self.sampled_draft_tokens = 0
        self.sampled_accepted_tokens = 0
        self.sampled_matched_tokens = 0
        self.decode_check_failures = 0
        self.plain_runs = 0  # proxy.plain_runs: requests the server decoded alone
        self.plain_run_tokens = 0
        self.draft_ms = Histogram(MS_BUCKETS)
        self.verify_ms = Histogram(MS_BUCKETS)
        self.server_ms = Histogram(MS_BUCKETS)  # llama-server's own share of verify_ms
        self.verify_prompt_tokens = 0
        self.overhead_ms = Histogram(MS_BUCKETS)
        self.server_idle_ms = Histogram(MS_BUCKETS)  # the round timeline's two idle gaps
        self.drafter_idle_ms = Histogram(MS_BUCKETS)
        self.tokens_per_second = Histogram(TPS_BUCKETS)

    def observe_round(self, record: RoundRecord) -> None:
        if record.plain_run:  # not a verify round: the server decoded alone
            self.plain_runs += 1
            self.plain_run_tokens += record.n_committed
            return
        self.rounds += 1
        self.empty_draft_rounds += record.n_drafted == 0
        self.runner_up_line_rounds += record.runner_up_line
        self.draft_tokens += record.n_drafted
        self.accepted_tokens += record.n_accepted
        self.reused_tokens += record.n_reused
        for position in range(record.n_drafted):
            self.drafted_per_position[position] += 1
            if position < record.n_accepted:
                self.accepted_per_position[position] += 1
        if record.n_matched is not None:
            self.sampled_draft_tokens += record.n_drafted
            self.sampled_accepted_tokens += record.n_accepted
            self.sampled_matched_tokens += record.n_matched
        self.draft_ms.observe(record.draft_ms)
        self.verify_ms.observe(record.verify_ms)
        self.server_ms.observe(record.server_ms)
        self.verify_prompt_tokens += record.server_prompt_tokens
        self.overhead_ms.observe(record.overhead_ms)
        self.server_idle_ms.observe(record.server_idle_ms)
        self.drafter_idle_ms.observe(record.drafter_idle_ms)
        if record.decodes is not None and record.decodes != 1 and not record.first:
            self.decode_check_failures += 1

    def observe_generation(self, n_tokens: int, seconds: float) -> None:
        self.generated_tokens += n_tokens
        if seconds > 0 and n_tokens > 0:
            self.tokens_per_second.observe(n_tokens / seconds)

    def observe_drafter_failure(self) -> None:
        self.drafter_failures += 1

    def observe_request(self, path: str) -> None:
        self.requests[path] += 1

    def render(self) -> str:
        lines: list[str] = []
        for name, help_text, attribute in COUNTERS:
            value = getattr(self, attribute)
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value:g}"]
        for name, help_text, per_position in (
            (
                "npu_spec_accepted_tokens_per_position_total",
                "Accepted draft tokens by draft position (0-based)",
                self.accepted_per_position,
            ),
            (
                "npu_spec_draft_tokens_per_position_total",
                "Drafted tokens by draft position (0-based)",
                self.drafted_per_position,
            ),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            for position in sorted(self.drafted_per_position):
                lines.append(f'{name}{{position="{position}"}} {per_position[position]}')
        name = "npu_spec_requests_total"
        lines += [f"# HELP {name} Requests by the path that served them", f"# TYPE {name} counter"]
        for path in ("speculative", "passthrough"):
            lines.append(f'{name}{{path="{path}"}} {self.requests[path]}')
        for name, help_text, attribute in HISTOGRAMS:
            lines += getattr(self, attribute).render(name, help_text)
        return "\n".join(lines) + "\n"


# (metric, help text, ProxyMetrics attribute), in the order /metrics shows them
COUNTERS = (
    ("npu_spec_rounds_total", "Draft/verify rounds (plain runs not counted)", "rounds"),
    (
        "npu_spec_empty_draft_rounds_total",
        "Verify rounds without a draft token (the drafter proposed nothing; for the bench's "
        "oracle: off every recorded path)",
        "empty_draft_rounds",
    ),
    (
        "npu_spec_runner_up_line_rounds_total",
        "Verify rounds after a miss whose draft came ready from the line drafted after the "
        "draft's runner-up there (--runner-up-lines)",
        "runner_up_line_rounds",
    ),
    ("npu_spec_draft_tokens_total", "Tokens proposed by the drafter", "draft_tokens"),
    ("npu_spec_accepted_tokens_total", "Draft tokens the target agreed with", "accepted_tokens"),
    (
        "npu_spec_ahead_tokens_total",
        "Drafts ready from drafting during verification",
        "reused_tokens",
    ),
    (
        "npu_spec_generated_tokens_total",
        "Tokens generated by requests on the speculative path, by verify rounds and plain "
        "runs alike (plain runs alone: npu_spec_plain_run_tokens_total)",
        "generated_tokens",
    ),
    (
        "npu_spec_plain_runs_total",
        "Plain runs: stretches llama-server decoded alone because speculating cost more",
        "plain_runs",
    ),
    (
        "npu_spec_plain_run_tokens_total",
        "Tokens of speculative-path requests that llama-server decoded alone (plain runs), "
        "not through verify rounds",
        "plain_run_tokens",
    ),
    (
        "npu_spec_sampled_draft_tokens_total",
        "Tokens proposed by the drafter for sampling (temperature > 0) requests",
        "sampled_draft_tokens",
    ),
    (
        "npu_spec_sampled_accepted_tokens_total",
        "Sampling-mode drafts accepted by the lossless speculative sampling rule",
        "sampled_accepted_tokens",
    ),
    (
        "npu_spec_sampled_greedy_match_tokens_total",
        "Sampling-mode drafts a match-only rule would have accepted (same drafts)",
        "sampled_matched_tokens",
    ),
    (
        "npu_spec_drafter_failures_total",
        "Requests that fell back to plain decoding after a drafter error",
        "drafter_failures",
    ),
    (
        "npu_spec_verify_prompt_tokens_total",
        "Prompt tokens llama-server's slots ingested for verify rounds (draft prefixes "
        "and what each slot lagged behind)",
        "verify_prompt_tokens",
    ),
    (
        "npu_spec_decode_check_failures_total",
        "Checked rounds where llama-server did not decode exactly once",
        "decode_check_failures",
    ),
)

HISTOGRAMS = (
    (
        "npu_spec_draft_ms",
        "Time each round waited for its draft (ms; drafting ahead hides the rest)",
        "draft_ms",
    ),
    ("npu_spec_verify_ms", "Verify request time per round (ms)", "verify_ms"),
    (
        "npu_spec_server_ms",
        "llama-server's own time per verify round (ms, its slot timings): the rest of "
        "npu_spec_verify_ms is HTTP, JSON and task handling",
        "server_ms",
    ),
    (
        "npu_spec_overhead_ms",
        "Proxy time per round outside drafting and verifying (ms)",
        "overhead_ms",
    ),
    (
        "npu_spec_server_idle_ms",
        "Per round, time from the generation's previous server response to this verify "
        "request: the server waits for drafting and the proxy's own work (ms)",
        "server_idle_ms",
    ),
    (
        "npu_spec_drafter_idle_ms",
        "Per round, time of the verify request during which the drafter was not "
        "drafting ahead (ms)",
        "drafter_idle_ms",
    ),
    (
        "npu_spec_tokens_per_second",
        "Generated tokens per second per speculative-path request (plain runs included)",
        "tokens_per_second",
    ),
)


def policy_page(policies: SharedPolicies) -> str:
    """What the draft-length, overlap, padding and plain-run policies measured and chose (gauges;
    a value not measured yet is left out)."""
    lengths = policies.draft_length.snapshot()
    overlap = policies.overlap.snapshot()
    runs = policies.plain_runs.snapshot()
    padding = policies.padding.snapshot()
    rows = [
        ("npu_spec_drafting_ahead", "1 while drafts are made during verification",
         1.0 if overlap["chosen"] else 0.0),
        ("npu_spec_drafting_ahead_saving_ms", "Drafting a round avoided by drafting ahead",
         overlap["saving_ms"]),
        ("npu_spec_drafting_ahead_penalty_ms", "Verify time drafting ahead added",
         overlap["penalty_ms"]),
        ("npu_spec_padded_rounds", "1 while verify rounds are padded to one batch shape",
         1.0 if padding["chosen"] else 0.0),
        ("npu_spec_padded_rounds_saving_ms", "Verify time a padded round saves (measured)",
         padding["saving_ms"]),
        ("npu_spec_draft_calibration", "Accepted drafts over the draft's own expectation",
         lengths["calibration"] if lengths["rounds"] else None),
        ("npu_spec_verify_ms_per_draft", "Verify time each extra draft adds (fitted)",
         lengths["verify_ms_per_draft"] if lengths["rounds"] else None),
        ("npu_spec_draft_acceptance", "Per-draft acceptance, accepted / (accepted + rejections)",
         lengths["acceptance"]),
        ("npu_spec_draft_token_ms", "Drafter time per token drafted fresh",
         lengths["draft_token_ms"]),
        ("npu_spec_draft_resync_ms", "Wait of a re-synced round beyond drafting its tokens",
         lengths["resync_ms"]),
        ("npu_spec_draft_length_chosen", "Draft length the formula chooses (drafting ahead)",
         lengths["formula_k_ahead"] if lengths["rule"] == "formula" else None),
        ("npu_spec_plain_runs_chosen", "1 while plain runs are cheaper than speculating",
         1.0 if runs["plain_chosen"] else 0.0),
        ("npu_spec_speculative_ms_per_token", "Steady speculative rounds, ms per token",
         runs["spec_ms_per_token"]),
        ("npu_spec_plain_run_ms_per_token", "Plain runs, ms per token",
         runs["plain_ms_per_token"]),
        ("npu_spec_shadow_acceptance",
         "Acceptance of the drafts checked beside plain runs, at the last due re-measurement",
         runs["shadow_acceptance"]),
        ("npu_spec_shadow_skipped_remeasurements",
         "Re-measurements of speculation skipped because drafts beside plain runs predicted a loss",
         float(runs["shadow_skipped"] or 0)),
        ("npu_spec_sampled_plain_runs_chosen",
         "1 while plain runs are cheaper than speculating, sampling requests",
         1.0 if policies.sampled_plain_runs.prefers_plain() else 0.0),
    ]  # fmt: skip
    lines: list[str] = []
    for name, help_text, value in rows:
        if value is not None:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value:g}"]
    return "\n".join(lines) + "\n" if lines else ""


class SlotCounts(Protocol):
    """What the slot sharing counts (`proxy.slot_share.SlotShare`)."""

    @property
    def active(self) -> int: ...

    @property
    def queued(self) -> int: ...

    @property
    def rejected(self) -> int: ...


def reliability_page(
    scheduler: SlotCounts,
    drafters: dict[str, Any],
    client_disconnects: int,
    upstream_failures: int,
    server_restarts: int | None,
) -> str:
    """Gauges and counters of the fault paths (Prometheus text): the scheduler's, the
    drafter supervisor's snapshot, the API's counts, and managed mode's restarts (None:
    attached)."""
    rows = [
        ("npu_spec_slot_groups_active", "gauge", "Slot groups held by generations",
         scheduler.active),
        ("npu_spec_queue_length", "gauge", "Requests waiting for a slot group",
         scheduler.queued),
        ("npu_spec_queue_rejections_total", "counter",
         "Requests refused with 503 because the queue was full", scheduler.rejected),
        ("npu_spec_drafter_sessions_open", "gauge", "Draft sessions not yet closed",
         drafters.get("sessions_open", 0)),
        ("npu_spec_drafter_faults_total", "counter",
         "Drafter errors, timeouts, bad drafts and failed opens (each served plainly)",
         drafters.get("failures", 0)),
        ("npu_spec_drafter_recreations_total", "counter",
         "Times the drafter was re-created after a failure", drafters.get("recreations", 0)),
        ("npu_spec_drafter_reloads_total", "counter",
         "Re-creations that loaded the drafter model again (a failed open, or a second "
         "failure in a row)", drafters.get("reloads", 0)),
        ("npu_spec_client_disconnects_total", "counter",
         "Requests to the speculative routes whose client went away", client_disconnects),
        ("npu_spec_upstream_failures_total", "counter",
         "Speculative requests ended by an unreachable or failing llama-server",
         upstream_failures),
    ]  # fmt: skip
    if server_restarts is not None:
        rows.append(
            ("npu_spec_server_restarts_total", "counter",
             "Times managed mode restarted a llama-server that died", server_restarts)
        )  # fmt: skip
    lines: list[str] = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}"]
    return "\n".join(lines) + "\n"


class ConcurrencyMetrics:
    """Streams sharing the server's slots (`proxy.slot_share`): the gauges it reports
    and the waits it measured, rendered like every other metric here."""

    def __init__(self) -> None:
        self.admission_wait_ms = Histogram(MS_BUCKETS)  # in the proxy's queue
        self.first_token_ms = Histogram(MS_BUCKETS)  # request arrival to its first token
        self.yields = 0
        self.resumes = 0
        self.rejected = 0

    def render(self, streams: int, speculating: int, queued: int, slots: int) -> str:
        rows = [
            ("npu_spec_streams_active", "gauge",
             "Generation requests being served (speculative and passed through)", streams),
            ("npu_spec_streams_speculating", "gauge",
             "Streams served by speculative rounds right now (not yielded)", speculating),
            ("npu_spec_requests_queued", "gauge",
             "Requests waiting because every llama-server slot has a stream", queued),
            ("npu_spec_server_slots", "gauge", "llama-server slots the streams share", slots),
            ("npu_spec_speculation_yields_total", "counter",
             "Times a speculating stream gave its extra slots up for other streams", self.yields),
            ("npu_spec_speculation_resumes_total", "counter",
             "Times a stream that had yielded speculated again", self.resumes),
        ]  # fmt: skip
        lines: list[str] = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}"]
        lines += self.admission_wait_ms.render(
            "npu_spec_admission_wait_ms", "Time a request waited in the proxy's queue (ms)"
        )
        lines += self.first_token_ms.render(
            "npu_spec_first_token_wait_ms",
            "Wait before the first token of a streamed generation request, from its arrival "
            "(ms; speculative and passed-through streams)",
        )
        return "\n".join(lines) + "\n"
