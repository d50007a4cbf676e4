"""The lab: the studies behind ``cachepilot experiment``, apart from the product they measure.

Simulator studies: :mod:`.seed_claims` (the original study's claims re-measured across seeds),
:mod:`.peers` (the default policy against the peer routers' models; its report
:mod:`.peers_report`), :mod:`.replicas`
(several gateway replicas, alone or synced). Real-worker studies: :mod:`.real_model` (hit
prediction on llama.cpp), :mod:`.real_peers` (CachePilot against sglang-router and
vllm-router on the same llama.cpp workers) with :mod:`.real_peers_report`, and
:mod:`.vllm_study` (the exact directory from vLLM's KV events) with :mod:`.vllm_report`;
their traffic is :mod:`.real_traffic`.

Shared by all: :mod:`.stats` (means with Student-t intervals, paired comparisons that respect
the measure's bounds, Holm's adjustment),
:mod:`.parallel` (a process pool over (workload, seed) tasks), :mod:`.plots` (matplotlib on
Agg, the paired-difference panel) and :mod:`.output` (the one writer of a study's folder).

Layer: on top, below only the CLI, which imports a study when its command runs. The product
(gateway, operator, simulator, tooling) never imports the lab; the lab starts the tooling's
stacks and the simulator. This package imports nothing itself, so importing one study does
not load the others.
"""
