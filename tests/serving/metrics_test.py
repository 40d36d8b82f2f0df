"""serving.metrics: the Prometheus series a scrape sees, before and after a request."""

from types import SimpleNamespace

from mmr_jax.serving import metrics


def _value(text: str, series: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(series))
    return float(line.split()[-1])


def test_token_counters_are_exported_at_zero_before_the_first_request():
    m = metrics.Metrics("tiny")
    text = m.exposition()
    assert _value(text, 'vllm:generation_tokens_total{model_name="tiny"}') == 0.0
    assert _value(text, 'vllm:prompt_tokens_total{model_name="tiny"}') == 0.0


def test_a_finished_request_counts_its_tokens():
    m = metrics.Metrics("tiny")
    choices = [SimpleNamespace(token_ids=[1, 2, 3], finish_reason="length")] * 2
    m.finished(5, choices)
    text = m.exposition()
    assert _value(text, 'vllm:generation_tokens_total{model_name="tiny"}') == 6.0
    assert _value(text, 'vllm:prompt_tokens_total{model_name="tiny"}') == 5.0
