"""Flow control: hold requests in the gateway instead of rejecting them, by priority band and
tenant, fairly, without losing prefix locality.

The model (docs/flow-control.md explains it with its settings):

* **Gate** (:mod:`.gate`): a worker is *open* while the requests waiting at it beyond its
  batch (the scraped queue plus what this gateway sent since the scrape that the batch
  cannot take) stay under ``hold_depth``. The gate is tight on purpose: a worker's own queue
  is FCFS, so only what the gateway still holds can be ordered by priority and fairness.
* **Hold**: a request no open worker should take waits in the gateway, in its pool's queue:
  one band per priority (higher first), one FIFO per tenant within a band (:mod:`.queue`).
  It is also held when the priced router says waiting for the busy worker that holds its
  prefix costs less than recomputing the prefix on an open one (for a bounded time).
* **Fair share** (:mod:`.fair`): each (band, tenant) has a virtual counter of weighted
  tokens served (input 1, output 2, with a half-life), charged at dispatch with an estimate
  and corrected at completion, and lifted to the band's minimum when the tenant becomes
  backlogged (VTC's rule). A tenant may be served only while its counter is within
  ``bend_tokens`` of the least-served backlogged tenant's.
* **Locality within fairness** (:mod:`.pick`): among the requests fairness allows, the one
  whose prefix an open worker holds (the most prefill ms saved) goes first, when it saves at
  least ``locality_gain_ms`` over the fair pick; ``bend_tokens`` bounds how far this can bend
  the fair order (two backlogged tenants' counters stay within ``bend_tokens`` plus one
  request's cost).
* **Bounds**: per band a queue size and a time to live (then 429 with Retry-After); a full
  band pushes out the newest request of the tenant holding most of it; sheddable requests
  (negative priority) are shed at once when they would wait; 503 only when no worker is
  ready.

Everything here is pure and driven with the caller's ``now`` (:mod:`.control`): the gateway
resolves asyncio futures, the simulator its virtual clock, tests plain calls.

The package ``__init__`` imports nothing, so :mod:`cachepilot.core.decision` can name
:class:`~cachepilot.core.flow.info.FlowInfo` without a cycle.
"""
