"""The API server emulator: a test double of kube-apiserver, served over HTTP on loopback.

``APIServer`` (``server``) routes each request; around it, by concern:

- the wire: ``serving`` (HTTP, URL routing, discovery), ``bodies`` (JSON as deep as kube-apiserver
  allows), ``protobuf`` (protobuf request bodies; stubs in ``proto_gen``), ``request`` (query
  options), ``openapi`` (the v2/v3 documents kubectl reads), ``tables`` (Table answers);
- storage: ``store`` (objects, resourceVersions, watch history), ``strategy`` (what is served and
  how each kind is written), ``patch`` (merge, strategic, JSON patch), ``apply`` (server-side apply
  and managed fields), ``selectors`` (label and field selectors), ``events`` (core and events.k8s.io);
- validation and admission: ``schema`` (the official JSON schemas, compiled), ``validation`` (what
  runs on every write), ``rules`` and ``core_rules`` (the server-side rules of the DRA and core
  kinds), ``formats`` (names, labels, quantities), ``crd`` and ``crd_schema`` (CustomResources and
  their structural schemas), ``scheduling`` (the gang API each release serves), ``policy`` (pod
  priority admission and eviction budgets), ``webhooks`` (which validating admission webhooks a write
  reaches, and what their answers mean), ``webhook_calls`` (one HTTPS call with its AdmissionReview)
  and ``webhook_rules`` (the configurations' defaults and rules).

May import: ``driver.allocator.celenv`` (CEL, as the server compiles selectors), ``driver.jsondepth``
and the libraries of the ``demo`` extra. The product never imports this package.
"""

from __future__ import annotations

from driver.cluster.apiserver.server import APIServer

__all__ = ["APIServer"]
