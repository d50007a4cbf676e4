from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachepilot.datalayer.engine_metrics import _samples, parse_metrics

VLLM = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 4.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.42
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 250.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="27000",enable_prefix_caching="True"} 1.0
"""


def test_vllm_current_names() -> None:
    m = parse_metrics(VLLM, "vllm", 5.0)
    assert (m.waiting, m.running, m.kv_usage) == (4, 7, 0.42)
    assert (m.prefix_queries, m.prefix_hits) == (1000.0, 250.0)
    assert (m.block_size, m.num_blocks, m.scraped_at) == (16, 27000, 5.0)


def test_vllm_old_kv_name_accepted() -> None:
    old = VLLM.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_metrics(old, "vllm", 0).kv_usage == 0.42


def test_missing_queue_gauges_is_an_error_not_idle() -> None:
    with pytest.raises(ValueError, match="num_requests_waiting"):
        parse_metrics("# nothing here\nfoo 1\n", "vllm", 0)


def test_garbage_and_unknown_engine_rejected() -> None:
    with pytest.raises(ValueError):
        parse_metrics("this is { not prometheus", "vllm", 0)
    with pytest.raises(ValueError, match="unknown engine"):
        parse_metrics(VLLM, "tgi", 0)


def test_llamacpp_and_sglang_mapping() -> None:
    text = ("llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n"
            "llamacpp:prompt_tokens_total 300\nllamacpp:prompt_tokens_cached_total 120\n")
    m = parse_metrics(text, "llamacpp", 0)
    assert (m.running, m.waiting, m.kv_usage, m.prefix_hits) == (2, 1, None, 120)
    s = parse_metrics("sglang:num_queue_reqs 3\nsglang:num_running_reqs 5\n"
                      "sglang:token_usage 0.7\n", "sglang", 0)
    assert (s.waiting, s.running, s.kv_usage) == (3, 5, 0.7)


REAL_VLLM = (Path(__file__).parents[1] / "data" / "vllm_metrics.txt").read_text()


def test_a_real_vllm_scrape_reads_as_the_whole_text_parsed() -> None:
    """vLLM 0.32's /metrics (614 lines, captured from the CPU worker): only the families
    read reach the parser, and they read exactly as parsing the whole text gives them."""
    whole: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(REAL_VLLM):
        for s in family.samples:
            whole.setdefault(s.name, []).append((s.labels, s.value))
    read = _samples(REAL_VLLM, "vllm")
    assert read and all(read[name] == whole[name] for name in read)
    assert "vllm:time_to_first_token_seconds_bucket" not in read  # histograms never parsed
    m = parse_metrics(REAL_VLLM, "vllm", 1.0)
    assert (m.waiting, m.running, m.kv_usage) == (0, 0, 0.0)
    assert (m.prefix_queries, m.prefix_hits, m.block_size) == (1896.0, 864.0, 32)
    assert m.num_blocks == 1820 and m.process_start == 1.79653347378e9


def test_a_broken_family_the_gateway_does_not_read_costs_nothing() -> None:
    broken = REAL_VLLM.replace("vllm:time_to_first_token_seconds_bucket{",
                               "vllm:time_to_first_token_seconds_bucket{{{", 1)
    assert parse_metrics(broken, "vllm", 0).prefix_hits == 864.0
    with pytest.raises(ValueError):  # one it reads still fails the scrape
        parse_metrics(REAL_VLLM.replace("vllm:num_requests_waiting{",
                                        "vllm:num_requests_waiting{{", 1), "vllm", 0)
