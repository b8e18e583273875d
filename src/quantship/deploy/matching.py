"""Values inside Kubernetes objects, read the way the API server and its neighbours read them:
resource quantities, label selectors, and the metric names prometheus-adapter rules serve."""

from __future__ import annotations

import re
from fractions import Fraction

import yaml

from quantship.deploy.kustomize import Doc
from quantship.files import load_yaml

_QUANTITY = re.compile(r"([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(?:[eE]([+-]?[0-9]+))?"
                       r"(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?")
_SCALE = {None: 1, "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "k": 10**3, "M": 10**6,
          "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
          "Pi": 2**50, "Ei": 2**60}


def parse_quantity(value) -> Fraction | None:
    m = _QUANTITY.fullmatch(str(value).strip())
    if not m:
        return None
    number, exponent, suffix = m.groups()
    return Fraction(number) * Fraction(10) ** int(exponent or 0) * _SCALE[suffix]


def selects(selector: dict | None, labels: dict | None) -> bool:
    """Does a LabelSelector (or a Service's plain map) select pods with these labels?"""
    if not selector:
        return False
    labels = labels or {}
    plain = selector if "matchLabels" not in selector and "matchExpressions" not in selector else None
    wanted = plain if plain is not None else selector.get("matchLabels") or {}
    if any(labels.get(k) != v for k, v in wanted.items()):
        return False
    for e in (selector.get("matchExpressions") or []) if plain is None else []:
        present, value = e.get("key") in labels, labels.get(e.get("key"))
        op, values = e.get("operator"), e.get("values") or []
        if not {"In": present and value in values, "NotIn": not present or value not in values,
                "Exists": present, "DoesNotExist": not present}.get(op, False):
            return False
    return True


def _go_template(text: str) -> str:
    return re.sub(r"\$\{(\d+)\}|\$(\d+)", lambda m: f"\\g<{m.group(1) or m.group(2)}>", text)


def adapter_metrics(context: list[Doc]) -> set[str]:
    """Metric names the prometheus-adapter rules found in ConfigMaps serve to the HPA."""
    names: set[str] = set()
    for doc in context:
        if doc.kind != "ConfigMap":
            continue
        for text in (doc.data.get("data") or {}).values():
            try:
                config = load_yaml(text)
            except yaml.YAMLError:
                continue
            if not isinstance(config, dict):
                continue
            for rule in (config.get("rules") or []) + (config.get("externalRules") or []):
                series = re.match(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", str(rule.get("seriesQuery", "")))
                if not series:
                    continue
                spec = rule.get("name") or {}
                pattern = re.compile(spec.get("matches") or "^.*$")
                match = pattern.search(series.group(1))
                if match:
                    default = "${1}" if pattern.groups else "${0}"
                    names.add(match.expand(_go_template(spec.get("as") or default)))
    return names
