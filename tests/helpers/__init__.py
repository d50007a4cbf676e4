"""What the tests share, and the only place they share it from: no test imports another
test module or a conftest (tests/test_layout.py checks). Imported as ``helpers`` (pytest's
``pythonpath`` in pyproject.toml puts tests/ on the path).

* :mod:`helpers.polling`: waiting for a condition (``until``, ``eventually``), never for a
  fixed time.
* :mod:`helpers.routers`: a router over three workers (``make_router``, ``WORKERS``).
* :mod:`helpers.tools`: whether a binary (Envoy, Helm…) is there to run.
* :mod:`helpers.kube`: the kopf operator against KMock (the cluster, pods, pools).
* :mod:`helpers.schemas`: the CRDs' schemas as validators, an InferencePool's body.
* the rest: fixtures of one subject each (ext_proc messages, a gateway without gRPC or in a
  thread, EPPs for the conformance suite, live metric scrapes, the vLLM environment…).
"""
