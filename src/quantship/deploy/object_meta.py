"""The API server's rules for names, labels and ports, which the OpenAPI schemas leave as plain strings:
object names (DNS-1123 subdomains; a Service's a DNS-1035 label), label keys and values and annotation
keys (qualified names), selector labels, container and port names, and named ports that must exist for
a probe to reach them. A manifest edited by hand fails `deploy validate` here, not `kubectl apply`."""

from __future__ import annotations

import re

LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?")  # IANA_SVC_NAME: 15 at most
NOT_API_OBJECTS = ("Kustomization",)  # kustomize's own configuration, never sent to a cluster


def is_subdomain(text: str) -> bool:
    return len(text) <= 253 and DNS_SUBDOMAIN.fullmatch(text) is not None


def qualified_name_problem(key) -> str | None:
    """Why `key` is not a label or annotation key ([prefix/]name), or None."""
    if not isinstance(key, str):
        return "is not a string"
    prefix, _, name = key.rpartition("/")
    if "/" in key and not is_subdomain(prefix):
        return "has a prefix that is not a DNS-1123 subdomain"
    if not name or len(name) > 63 or not LABEL_VALUE.fullmatch(name):
        return "is not a qualified name (63 characters at most: letters, digits, '-', '_', '.', alphanumeric at both ends)"
    return None


def _labels(checker, doc, labels, where: str) -> None:
    if not isinstance(labels, dict):
        return
    for key, value in labels.items():
        problem = qualified_name_problem(key)
        if problem:
            checker.fail(doc, f"{where}[{key!r}]", f"label key {problem}")
        if not isinstance(value, str) or not LABEL_VALUE.fullmatch(value):
            checker.fail(doc, f"{where}[{key!r}]", f"label value {value!r} is not valid (63 characters at most: "
                         "letters, digits, '-', '_', '.', alphanumeric at both ends)")


def _meta(checker, doc, meta: dict, where: str, name_rule=None) -> None:
    name = meta.get("name")
    if name_rule is not None and name is not None:
        pattern, what = name_rule
        if not isinstance(name, str) or not pattern(name):
            checker.fail(doc, f"{where}.name", f"{name!r} is not a {what}")
    _labels(checker, doc, meta.get("labels"), f"{where}.labels")
    for key in meta.get("annotations") or {}:
        problem = qualified_name_problem(key)
        if problem:
            checker.fail(doc, f"{where}.annotations[{key!r}]", f"annotation key {problem}")


def _containers(checker, doc, pod: dict) -> None:
    for group in ("initContainers", "containers"):
        for i, c in enumerate(pod.get(group) or []):
            where = f"spec.template.spec.{group}[{i}]"
            if not isinstance(c.get("name"), str) or not DNS_LABEL.fullmatch(c["name"]):
                checker.fail(doc, f"{where}.name", f"{c.get('name')!r} is not a DNS-1123 label")
            if not str(c.get("image") or "").strip():
                checker.fail(doc, f"{where}.image", "empty: the pods could not start")
            names = set()
            for j, port in enumerate(c.get("ports") or []):
                name = port.get("name")
                if name is None:
                    continue
                names.add(name)
                if not isinstance(name, str) or not PORT_NAME.fullmatch(name) or "--" in name \
                        or not any(ch.isalpha() for ch in name):
                    checker.fail(doc, f"{where}.ports[{j}].name", f"{name!r} is not a port name (15 characters at "
                                 "most: lowercase letters, digits and '-', at least one letter)")
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                for kind in ("httpGet", "tcpSocket"):
                    port = ((c.get(probe) or {}).get(kind) or {}).get("port")
                    if isinstance(port, str) and port not in names:  # a number needs no declared port
                        checker.fail(doc, f"{where}.{probe}.{kind}.port",
                                     f"no port named {port!r} in this container: the probe would never pass")


SERVICE_NAME = (lambda n: DNS_1035_LABEL.fullmatch(n) is not None,
                "DNS-1035 label (a Service name: a lowercase letter first, then letters, digits, '-', 63 at most)")
OBJECT_NAME = (is_subdomain, "DNS-1123 subdomain (lowercase letters, digits, '-', '.', 253 at most)")


def check_object_meta(checker) -> None:
    for doc in checker.objects:
        if doc.kind in NOT_API_OBJECTS:
            continue
        _meta(checker, doc, doc.data.get("metadata") or {}, "metadata",
              SERVICE_NAME if doc.kind == "Service" else OBJECT_NAME)
        selector = checker.spec(doc).get("selector")
        if isinstance(selector, dict):  # a Service selects by labels, the workloads by matchLabels
            service = doc.kind == "Service"
            _labels(checker, doc, selector if service else selector.get("matchLabels"),
                    "spec.selector" if service else "spec.selector.matchLabels")
    for doc, template in checker.templates():
        _meta(checker, doc, template.get("metadata") or {}, "spec.template.metadata")
        _containers(checker, doc, template.get("spec") or {})
