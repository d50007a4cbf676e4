"""CachePilot's gateway adapters: Envoy ext_proc over gRPC, Envoy bootstrap generation,
metrics scraping, the admin API and the local stack. The routing itself is
:mod:`cachepilot.core`; nothing here scores a worker."""
