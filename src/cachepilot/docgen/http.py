"""The HTTP reference: the headers CachePilot adds or reads (named by the constants in
cachepilot.gateway.protocol), every error answer (cachepilot.gateway.errors.ERRORS) and the
admin API's routes (read from the gateway's own aiohttp application)."""

from __future__ import annotations

from pathlib import Path

from cachepilot.core.request import RequestError
from cachepilot.docgen.markdown import code, generated_note, prose, table
from cachepilot.gateway import protocol
from cachepilot.gateway.errors import ENVOY, GATEWAY, by_source

PATH = "reference/http.md"

# protocol.py constant → (where it appears, what it means). Every *_HEADER constant must be
# here (tests/docgen/test_docgen.py), so a new header cannot go undocumented.
HEADERS: dict[str, tuple[str, str]] = {
    "DECISION_HEADER": (
        "response; request to the worker",
        "The decision's id: `cachepilot explain ID --log DIR`, `GET /decisions/{id}` on the "
        "admin port. Every routed response carries it."),
    "WORKER_HEADER": (
        "response",
        "The worker that answered (`host:port`), set by Envoy from the upstream it used: "
        "after a retry it names the runner-up, not the first choice."),
    "ERROR_HEADER": (
        "response (Envoy's error replies)",
        "The error's type when Envoy answered itself (`worker_unreachable`, "
        "`gateway_unavailable`, …), so the gateway and clients can tell it from a worker's "
        "error."),
    "DESTINATION_HEADER": (
        "request to the worker; EPP response to the proxy",
        "The chosen endpoint (`ip:port`). In the endpoint picker protocol it is also set in "
        "dynamic metadata `envoy.lb`; CachePilot's own Envoy config routes on the metadata "
        "and copies it into this header for the worker."),
    "MODEL_REWRITE_HEADER": (
        "request (EPP)",
        "Routes and serves the request as this model name instead of the body's; the "
        "response's model name is rewritten back to the client's."),
    "REQUEST_ID_HEADER": (
        "request (EPP)", "Kept when the client sent one, else generated (as the reference EPP "
                         "does)."),
    "SHED_HEADER": (
        "response (flow control's 429 and 503)",
        "Why flow control refused the request (`queue_full`, `ttl_expired`, `sheddable`, "
        "`slo_unmeetable`, …; the request headers it reads are in "
        "[Flow control](../flow-control.md))."),
    "SERVED_REPORT_HEADER": (
        "response (EPP)", "The endpoint that served the request, echoed for the upstream "
                          "conformance tests."),
}
RETRY_AFTER = ("retry-after", "response (429, 503)",
               "Seconds to wait before retrying: every error answer marked so below.")

# Admin API route → what it answers. Every GET route of the gateway's admin application
# must be here (tests/docgen/test_docgen.py).
ADMIN: dict[str, str] = {
    "/healthz": "Always 200 while the process serves (liveness). Public.",
    "/readyz": "200 while this replica has a ready worker with fresh metrics, else 503 "
               "(readiness: the chart's Service skips a replica whose view is empty). Public.",
    "/metrics": "Prometheus exposition ([Metrics](metrics.md)). Public.",
    "/workers": "Every worker: readiness, why it is `down`, in flight, pending prefill, last "
                "scrape (waiting, running, KV usage, when, error), directory mode, KV-event "
                "counters.",
    "/pools": "Every pool: models, policy, weights, block size, decisions, directory size "
              "and modes.",
    "/flow": "Flow control now: the settings in force, the requests held, the "
             "InferenceObjectives' priorities, and per pool and band the requests held by "
             "tenant, the oldest wait and the fairness lag in weighted tokens "
             "([Flow control](../flow-control.md)); 404 when it is off.",
    "/decisions/{id}": "One decision record with its outcome and a plain explanation "
                       "(needs `--decision-log`; 404 without).",
    "/predictor": "Each worker's learned TTFT model and the predictor's recent accuracy "
                  "(404 with `--no-calibrate`).",
    "/replicas": "This replica's exchange with the others over NATS (404 without "
                 "`--replica-bus`).",
}


def header_constants() -> dict[str, str]:
    return {k: v for k, v in vars(protocol).items()
            if k.endswith("_HEADER") and isinstance(v, str)}


def admin_routes() -> list[str]:
    """The GET routes of the gateway's admin application, as it builds them."""
    from cachepilot.core import Router
    from cachepilot.gateway.server import Gateway

    app = Gateway(Router())._admin_app()
    return [r.resource.canonical for r in app.router.routes()
            if r.method == "GET" and r.resource is not None]


def _errors(source: str) -> str:
    rows = [[str(e.status) if e.status is not None else "Envoy's", code(e.type),
             "yes" if e.retry_after else "", prose(e.when), prose(e.action)]
            for e in by_source(source)]
    return table(["status", "type", "Retry-After", "when", "what to do"], rows)


def page(_root: Path) -> str:
    consts = header_constants()
    missing = sorted(set(consts) - set(HEADERS))
    if missing:
        raise ValueError(f"headers with no description in cachepilot.docgen.http: {missing}")
    rows = [[code(consts[k]), where, prose(what)] for k, (where, what) in HEADERS.items()]
    rows.append([code(RETRY_AFTER[0]), RETRY_AFTER[1], prose(RETRY_AFTER[2])])
    routes = admin_routes()
    undocumented = sorted(set(routes) - set(ADMIN))
    if undocumented:
        raise ValueError(f"admin routes with no description: {undocumented}")
    example = RequestError(404, "model 'gpt-x' is not served here; models: ['sim-llama-8b']",
                           code="model_not_found").to_json().decode()
    return "\n".join([
        "# HTTP: headers, errors, admin API\n",
        generated_note("src/cachepilot/gateway/protocol.py", "src/cachepilot/gateway/errors.py",
                       "src/cachepilot/gateway/server.py"),
        "## Headers\n",
        table(["header", "where", "meaning"], rows),
        "## Errors\n",
        "Every error comes back as OpenAI's error envelope, so an unmodified OpenAI client "
        "raises it with the message. For example (the gateway's 404):\n",
        f"```json\n{example}\n```\n",
        "`tests/gateway/test_error_table.py` checks these tables against the code both ways: every "
        "error the gateway raises and every reply in the generated Envoy bootstrap has its "
        "row, and every row is still produced. [Troubleshooting](../troubleshooting.md) "
        "says what to look at for each.\n",
        "### Answered by the gateway\n",
        "The gateway answers through ext_proc (an immediate response): no worker is "
        "contacted.\n",
        _errors(GATEWAY),
        "### Answered by Envoy\n",
        "From the bootstrap the gateway generates (`cachepilot envoy-config`, the chart's "
        "`files/envoy.yaml`); these also carry "
        f"`{protocol.ERROR_HEADER}: <type>`.\n",
        _errors(ENVOY),
        "A worker's own error (its 4xx or 5xx) passes through unchanged; the gateway counts "
        "it in `cachepilot_request_errors_total{source=\"upstream\"}`.\n",
        "## Admin API\n",
        "On the admin port (`--admin-port`, 9090 in the chart). Off loopback it needs "
        "`Authorization: Bearer <token>` (`--admin-token`; the chart makes a Secret), except "
        "the public routes.\n",
        table(["GET", "answers"], [[code(r), prose(ADMIN[r])] for r in routes]),
    ])
