"""The worker's custom metrics, as TorchServe publishes them (metrics.yaml declares them;
docs/api.md lists them). Rank 0 records them: every rank's metrics reach the frontend."""

import time

from ts.metrics.metric_type_enum import MetricTypes

from api import Job


def record_engine(metrics, engine, steps: int, engine_ms: float):
    """The engine's state after an iteration's steps, as gauges."""
    pool = engine.pool
    for name, value in (("KVBlocksInUse", pool.num_used), ("KVBlocksTotal", pool.num_blocks),
                        ("SequencesRunning", len(engine.scheduler.running)),
                        ("SequencesWaiting", len(engine.scheduler.waiting)),
                        ("PrefixCacheHitRate", pool.hits / pool.queries if pool.queries else 0.0),
                        ("EngineSteps", steps)):
        metrics.add_metric(name, value, "count", metric_type=MetricTypes.GAUGE)
    metrics.add_metric("EngineTime", engine_ms, "ms", metric_type=MetricTypes.GAUGE)
    spec = engine.speculation
    if spec:
        for name, value in (("SpeculativeProposed", spec.proposed), ("SpeculativeAccepted", spec.accepted),
                            ("SpeculativeAcceptedPerStep", spec.mean_accepted)):
            metrics.add_metric(name, value, "count", metric_type=MetricTypes.GAUGE)


def record_request(metrics, job: Job):
    """Token counts and latencies of a finished request (nothing for one that never ran)."""
    if not job.seqs or job.first_token is None:
        return
    completion = max(len(s.tokens) for s in job.seqs)
    metrics.add_counter("PromptTokens", sum(len(s.prompt_tokens) for s in job.seqs[::job.request.n]))
    metrics.add_counter("CompletionTokens", sum(len(s.sampled) for s in job.seqs))  # stop ids too
    # Seconds: TorchServe 0.12 gives histograms Prometheus' default buckets (5 ms to 10 s)
    # and has no setting for others, so milliseconds would all land in +Inf.
    metrics.add_metric("TimeToFirstToken", job.first_token - job.arrival, "s", metric_type=MetricTypes.HISTOGRAM)
    if completion > 1:
        per_token = (time.perf_counter() - job.first_token) / (completion - 1)
        metrics.add_metric("TimePerOutputToken", per_token, "s", metric_type=MetricTypes.HISTOGRAM)
