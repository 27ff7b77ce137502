"""The server's counters, gauges and histograms, exposed in Prometheus' text format at ``GET /metrics``.

Names follow vLLM's where the meaning is the same (``*_spec_decode_num_drafts_total``, ``*_num_draft_tokens_total``,
``*_num_accepted_tokens_total``), so dashboards made for it port over. Written from the decode thread and the HTTP
handlers alike, hence one lock.
"""

from __future__ import annotations

import threading
from bisect import bisect_left

PREFIX = "fastforward"

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, cumulative = [], 0
        sep = "," if labels else ""
        for bound, n in zip(self.buckets, self.counts, strict=False):
            cumulative += n
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        lab = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{lab} {self.sum:.6f}", f"{name}_count{lab} {self.count}"]
        return out


class Metrics:
    """Everything ``/metrics`` shows; update through the methods (thread-safe)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, status code) -> count
        self.per_method: dict[str, dict[str, int]] = {}  # method -> counters
        self.forwards = 0  # shared target forwards of the decode loop (one per group of sequences)
        self.forward_rows = Histogram(ROWS_BUCKETS)
        self.forward_sequences = Histogram(ROWS_BUCKETS)
        self.forward_seconds = 0.0
        self.latency = Histogram(LATENCY_BUCKETS)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.queue_wait = Histogram(LATENCY_BUCKETS)
        self.waiting = 0
        self.running = 0
        self.cancelled = 0
        self.prefix_queries = self.prefix_hits = self.prefix_tokens = 0

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            key = (endpoint, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1

    def forward(self, sequences: int, rows: int, seconds: float) -> None:
        with self.lock:
            self.forwards += 1
            self.forward_rows.observe(rows)
            self.forward_sequences.observe(sequences)
            self.forward_seconds += seconds

    def prefix_cache(self, cache) -> None:
        """The prefix cache's counters after a prompt was read (prompt tokens looked up, found, kept now)."""
        with self.lock:
            self.prefix_queries, self.prefix_hits, self.prefix_tokens = cache.queries, cache.hits, cache.tokens

    def queue(self, waiting: int, running: int) -> None:
        with self.lock:
            self.waiting, self.running = waiting, running

    def finished(self, method: str, *, prompt_tokens: int, completion_tokens: int, forwards: int, drafts: int,
                 draft_tokens: int, accepted_tokens: int, latency: float, ttft: float | None, queue_wait: float,
                 cancelled: bool) -> None:
        with self.lock:
            m = self.per_method.setdefault(method, dict.fromkeys(
                ("requests", "prompt_tokens", "generation_tokens", "sequence_forwards", "drafts", "draft_tokens",
                 "accepted_tokens"), 0))
            m["requests"] += 1
            m["prompt_tokens"] += prompt_tokens
            m["generation_tokens"] += completion_tokens
            m["sequence_forwards"] += forwards
            m["drafts"] += drafts
            m["draft_tokens"] += draft_tokens
            m["accepted_tokens"] += accepted_tokens
            self.cancelled += int(cancelled)
            if not cancelled:
                self.latency.observe(latency)
            if ttft is not None:
                self.ttft.observe(ttft)
            self.queue_wait.observe(queue_wait)

    def render(self) -> str:
        p = PREFIX
        with self.lock:
            lines = [f"# HELP {p}_http_requests_total HTTP requests by endpoint and status code.",
                     f"# TYPE {p}_http_requests_total counter"]
            lines += [f'{p}_http_requests_total{{endpoint="{e}",code="{c}"}} {n}'
                      for (e, c), n in sorted(self.requests.items())]
            for key, help_text in (
                    ("requests", "Generation requests finished (or cancelled), by decoding method."),
                    ("prompt_tokens", "Prompt tokens read, by decoding method."),
                    ("generation_tokens", "Tokens generated, by decoding method."),
                    ("sequence_forwards", "Target forwards per sequence (prefill included; shared forwards count "
                                          "once per sequence in them)."),
                    ("drafts", "Verification steps that carried a draft (spec_decode_num_drafts)."),
                    ("draft_tokens", "Draft tokens proposed (spec_decode_num_draft_tokens)."),
                    ("accepted_tokens", "Draft tokens accepted (spec_decode_num_accepted_tokens)."),
            ):
                name = {"drafts": f"{p}_spec_decode_num_drafts_total",
                        "draft_tokens": f"{p}_spec_decode_num_draft_tokens_total",
                        "accepted_tokens": f"{p}_spec_decode_num_accepted_tokens_total"}.get(key, f"{p}_{key}_total")
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
                lines += [f'{name}{{method="{method}"}} {counts[key]}' for method, counts in
                          sorted(self.per_method.items())]
            lines += [f"# HELP {p}_cancelled_requests_total Requests whose client went away before the end.",
                      f"# TYPE {p}_cancelled_requests_total counter", f"{p}_cancelled_requests_total {self.cancelled}",
                      f"# HELP {p}_target_forwards_total Target forwards run by the decode loop (shared ones once).",
                      f"# TYPE {p}_target_forwards_total counter", f"{p}_target_forwards_total {self.forwards}",
                      f"# HELP {p}_target_forward_seconds_total Time in the decode loop's target forwards.",
                      f"# TYPE {p}_target_forward_seconds_total counter",
                      f"{p}_target_forward_seconds_total {self.forward_seconds:.6f}",
                      f"# HELP {p}_prefix_cache_queries_total Prompt tokens looked up in the prefix cache.",
                      f"# TYPE {p}_prefix_cache_queries_total counter",
                      f"{p}_prefix_cache_queries_total {self.prefix_queries}",
                      f"# HELP {p}_prefix_cache_hits_total Prompt tokens whose KV came from the prefix cache.",
                      f"# TYPE {p}_prefix_cache_hits_total counter", f"{p}_prefix_cache_hits_total {self.prefix_hits}",
                      f"# HELP {p}_prefix_cache_tokens Prompt tokens the prefix cache holds now.",
                      f"# TYPE {p}_prefix_cache_tokens gauge", f"{p}_prefix_cache_tokens {self.prefix_tokens}",
                      f"# HELP {p}_num_requests_waiting Requests queued, not yet decoding.",
                      f"# TYPE {p}_num_requests_waiting gauge", f"{p}_num_requests_waiting {self.waiting}",
                      f"# HELP {p}_num_requests_running Sequences decoding now.",
                      f"# TYPE {p}_num_requests_running gauge", f"{p}_num_requests_running {self.running}"]
            for name, hist, help_text in (
                    ("request_latency_seconds", self.latency, "Time from arrival to the last token."),
                    ("time_to_first_token_seconds", self.ttft, "Time from arrival to the first token."),
                    ("queue_wait_seconds", self.queue_wait, "Time from arrival to the start of decoding."),
                    ("forward_rows", self.forward_rows, "Rows (tokens) per shared target forward."),
                    ("forward_sequences", self.forward_sequences, "Sequences per shared target forward.")):
                lines += [f"# HELP {p}_{name} {help_text}", f"# TYPE {p}_{name} histogram"]
                lines += hist.lines(f"{p}_{name}")
        return "\n".join(lines) + "\n"
