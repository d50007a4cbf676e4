"""Where each rule comes from: a sentence of the protocol proposal, a line of the reference
EPP's code, the upstream conformance docs, or an issue users filed. Every citation names the
repository, the path with its lines, and the commit it was read at (docs/epp.md lists them)."""

from __future__ import annotations

from dataclasses import dataclass

GIE = "kubernetes-sigs/gateway-api-inference-extension"
# The protocol text (v1.0.0); identical in the GIE release v1.6.0 (992e5c29, 2026-08-10).
PROTOCOL_COMMIT = "84436a96b9e6"
PROTOCOL_PATH = "docs/proposals/004-endpoint-picker-protocol/README.md"
PROTOCOL_VERSION = "v1.0.0"
GIE_RELEASE = "v1.6.0"
# The full reference EPP: the last tree with pkg/epp (a70292c1 removed it, 2026-06-17).
EPP_COMMIT = "1748e829d116"
# The lightweight reference EPP and the conformance machinery: HEAD when read.
LWEPP_COMMIT = PROTOCOL_COMMIT


@dataclass(frozen=True)
class Source:
    where: str  # a path in ``repo`` with its lines, or a URL
    commit: str = ""
    repo: str = GIE
    quote: str = ""  # the sentence, verbatim, or what the code does

    def cite(self) -> str:
        if self.where.startswith("https://"):
            return self.where
        return f"{self.repo} {self.where}" + (f" @{self.commit}" if self.commit else "")

    def as_dict(self) -> dict[str, str]:
        out = {"citation": self.cite()}
        if self.quote:
            out["quote"] = self.quote
        return out


def proto(lines: str, quote: str) -> Source:
    """A sentence of the protocol proposal (``lines`` as ``L42`` or ``L50-52``)."""
    return Source(f"{PROTOCOL_PATH} {lines}", PROTOCOL_COMMIT, quote=quote)


def epp(path: str, lines: str, what: str) -> Source:
    """The full reference EPP's code."""
    return Source(f"{path} {lines}".strip(), EPP_COMMIT, quote=what)


def lwepp(path: str, lines: str, what: str) -> Source:
    """The lightweight reference EPP (pkg/lwepp) or other files at HEAD."""
    return Source(f"{path} {lines}".strip(), LWEPP_COMMIT, quote=what)


def issue(url: str, what: str) -> Source:
    return Source(url, quote=what)


def envoy_doc(url: str, what: str) -> Source:
    return Source(url, quote=what)
