"""What the tests share, and the only place they share it from: no test imports another
test module or a conftest (tests/test_layout.py checks). Imported as ``helpers`` (pytest's
``pythonpath`` in pyproject.toml puts tests/ on the path).

* :mod:`helpers.polling`: waiting for a condition (``until``, ``eventually``,
  ``seconds_until``, ``holds_for``), never for a fixed time.
* :mod:`helpers.paths`: the repository's root and tests/data/.
* :mod:`helpers.routers`: a router over three workers (``make_router``, ``WORKERS``).
* :mod:`helpers.tools`: whether a binary (Envoy, Helm…) is there to run.
* :mod:`helpers.kube`: the kopf operator against KMock (the cluster, pods, pools).
* :mod:`helpers.schemas`: the CRDs' schemas as validators, an InferencePool's body.
* :mod:`helpers.records`: a router and its decisions for the decision-log tests.
* :mod:`helpers.delivery`: whether replicas' (or processes') messages to each other arrived.
* the rest, one subject each: ext_proc messages (``extproc_msgs``), a gateway without gRPC
  (``gateway_box``) or in a thread (``gateway_thread``), EPPs for the conformance suite
  (``independent_epp``, ``broken_epps``), live metric scrapes (``metrics_live``), the
  simulator's calls into the core (``sim_calls``), the flow-control drill's traffic
  (``flow_drill``), chat conversations (``chat_corpus``) and the vLLM environment
  (``vllm_env``).
"""
