"""`quantship deploy validate DIR`: every object offline, strictly, before anything reaches a cluster.

- Core kinds against the Kubernetes OpenAPI schemas bundled with `kubernetes-validate` (strict:
  an unknown field, such as a misspelt probe setting, is an error). K8S_VERSION is the API we target.
- Custom kinds (Argo Rollout and AnalysisTemplate, KEDA ScaledObject, Kustomization) against the
  JSON schemas in schemas/. A kind neither knows is an error, not a warning.
- Each kustomization is built (kustomize.py) and its objects checked together (semantics.py).
- Prometheus rule files go through `promtool check rules` when promtool is installed, and so does every
  PromQL query of a Grafana dashboard ConfigMap (label grafana_dashboard).
Every message names the file, the object and the field path.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from quantship.deploy.kustomize import Doc, build
from quantship.errors import QuantshipError
from quantship.files import load_yaml

K8S_VERSION = "1.30"
SCHEMA_DIR = Path(__file__).parent / "schemas"
CUSTOM_KINDS = ("Rollout", "AnalysisTemplate", "ScaledObject", "Kustomization")


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    objects: int = 0
    files: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    builds: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _seen: set = field(default_factory=set, repr=False)

    def add(self, problem: str) -> None:
        # A base object seen again, patched, in an overlay's build reports the same problem once.
        key = re.sub(r" \(patched by [^)]*\)", "", problem)
        if key not in self._seen:
            self._seen.add(key)
            self.problems.append(problem)


def field_path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(object)"


@functools.cache
def _custom_schemas():
    from referencing import Registry, Resource

    registry, schemas = Registry(), {}
    for path in SCHEMA_DIR.glob("*.json"):
        schema = json.loads(path.read_text(encoding="utf-8"))
        registry = registry.with_resource(schema["$id"], Resource.from_contents(schema))
        schemas[path.stem] = schema
    return registry, schemas


def _custom_key(data: dict) -> str:
    group_version = str(data.get("apiVersion", ""))
    group, _, version = group_version.rpartition("/")
    return f"{str(data.get('kind', '')).lower()}-{group.split('.')[0] or 'core'}-{version}"


def _explain(error) -> list[tuple[list, str]]:
    """jsonschema errors as (field path, message), naming the offending field itself."""
    path = list(error.absolute_path if hasattr(error, "absolute_path") else error.path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = set(error.schema.get("properties", {}))
        patterns = list(error.schema.get("patternProperties", {}))
        extra = [k for k in error.instance if k not in known and not any(re.search(p, k) for p in patterns)]
        if extra:
            return [(path + [k], "unknown field") for k in extra]
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = [k for k in error.validator_value if k not in error.instance]
        if missing:
            return [(path + [k], "required field is missing") for k in missing]
    return [(path, error.message if len(error.message) < 300 else error.message[:300] + "...")]


def schema_problems(data: dict) -> list[tuple[list, str]]:
    import jsonschema
    import kubernetes_validate

    key = _custom_key(data)
    registry, schemas = _custom_schemas()
    if key in schemas:
        validator = jsonschema.Draft202012Validator(schemas[key], registry=registry)
        found = [item for e in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
                 for item in _explain(e)]
        template = (data.get("spec") or {}).get("template")
        if data.get("kind") == "Rollout" and isinstance(template, dict):
            # A Rollout's pod template is a core PodTemplateSpec: check it as a Deployment's.
            wrapper = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "rollout-template"},
                       "spec": {"selector": {"matchLabels": {"x": "x"}}, "template": template}}
            found += schema_problems(wrapper)
        return found
    if data.get("kind") in CUSTOM_KINDS:
        known = sorted(k for k in schemas if k.startswith(str(data.get("kind")).lower()))
        return [(["apiVersion"], f"{data.get('kind')} is known only as {', '.join(known)}")]
    try:
        kubernetes_validate.validate(data, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return _explain(e)
    except kubernetes_validate.SchemaNotFoundError:
        return [(["kind"], f"unknown kind {data.get('kind')} ({data.get('apiVersion')}): not in Kubernetes "
                           f"{K8S_VERSION} nor among the custom kinds quantship knows ({', '.join(CUSTOM_KINDS)})")]
    return []


def _is_rules_file(data) -> bool:
    return isinstance(data, dict) and "groups" in data and "kind" not in data


class _Loader:
    """Parses each YAML file once; keeps the Docs for the kustomize builds."""

    def __init__(self, root: Path, report: Report):
        self.root, self.report, self.cache, self.rule_files = root, report, {}, []

    def __call__(self, path: Path) -> list[Doc]:
        path = path.resolve()
        if path not in self.cache:
            self.cache[path] = self._parse(path)
        return self.cache[path]

    def shown(self, path: Path) -> str:
        """The path as the user wrote DIR, so messages read 'k8s/base/deployment.yaml'."""
        try:
            return str(self.root / path.resolve().relative_to(self.root.resolve()))
        except ValueError:
            return str(path)

    def _parse(self, path: Path) -> list[Doc]:
        shown = self.shown(path)
        try:
            raw = [d for d in load_yaml(path.read_text(encoding="utf-8"), all_documents=True) if d is not None]
        except (OSError, UnicodeDecodeError) as exc:
            self.report.add(f"{shown}: unreadable ({exc})")
            return []
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", "")
            self.report.add(f"{shown}: invalid YAML: {str(exc).splitlines()[0]} {where}".strip())
            return []
        docs = []
        for i, data in enumerate(raw):
            if _is_rules_file(data):
                self.rule_files.append(path)
            elif isinstance(data, dict) and data.get("apiVersion") and data.get("kind"):
                docs.append(Doc(path, data, shown))
            else:
                self.report.add(f"{shown}: document {i + 1}: not a Kubernetes object (needs apiVersion and kind)")
        return docs


def _check_rule_files(paths: list[Path], loader: _Loader, report: Report) -> None:
    promtool = shutil.which("promtool")
    if not paths:
        return
    if promtool is None:
        report.notes.append("promtool not found: Prometheus rule files were not checked")
        return
    failed = 0
    for path in paths:
        proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            failed += 1
            report.add(f"{loader.shown(path)}: promtool check rules: {' '.join((proc.stderr or proc.stdout).split())}")
    if not failed:
        report.notes.append(f"{len(paths)} Prometheus rule file(s) passed promtool check rules")


def _check_dashboards(docs: list[Doc], report: Report) -> None:
    """Every PromQL query of a Grafana dashboard ConfigMap through `promtool check rules`."""
    import tempfile

    from quantship.deploy.dashboard import SIDECAR_LABEL, as_rules, dashboard_queries

    promtool = shutil.which("promtool")
    boards = [d for d in docs if d.kind == "ConfigMap" and SIDECAR_LABEL in ((d.data.get("metadata") or {}).get("labels") or {})]
    if not boards or promtool is None:
        return
    for doc in boards:
        try:
            queries = dashboard_queries(doc.data)
        except (json.JSONDecodeError, TypeError, KeyError, AttributeError) as exc:
            report.add(f"{doc.where()}: {doc.ident}: data: not Grafana dashboard JSON ({exc})")
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            f.write(yaml.safe_dump(as_rules(queries)))
            f.flush()
            proc = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            report.add(f"{doc.where()}: {doc.ident}: a panel's PromQL does not parse: "
                       f"{' '.join((proc.stderr or proc.stdout).split())}")
        else:
            report.notes.append(f"{doc.ident}: {len(queries)} dashboard queries passed promtool check rules")


def validate_dir(directory: str | Path) -> Report:
    from quantship.deploy.semantics import check_build

    root = Path(directory)
    if not root.is_dir():
        raise QuantshipError("not a directory of manifests", root)
    report = Report()
    loader = _Loader(root, report)
    files = sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    report.files = len(files)
    everything = [doc for path in files for doc in loader(path)]
    if not everything:  # "0 objects ... valid" would wave an empty or mistyped directory through
        report.add(f"{root}: no Kubernetes objects found ({len(files)} YAML file(s) read)")
    for doc in everything:
        report.objects += 1
        report.kinds[doc.kind] = report.kinds.get(doc.kind, 0) + 1
        for parts, message in schema_problems(doc.data):
            report.add(f"{doc.where()}: {doc.ident}: {field_path(parts)}: {message}")
    kustomizations = [d for d in everything if d.kind == "Kustomization"]
    builds = [(d.origin, *build(d.file, loader, loader.shown)) for d in kustomizations] or \
             [(str(root), [d for d in everything if d.kind != "Kustomization"], [])]
    for name, objects, problems in builds:
        report.builds.append(name)
        for problem in problems:
            report.add(problem)
        for doc in objects:
            if doc.patched_by:  # a patch can break what the file alone got right
                for parts, message in schema_problems(doc.data):
                    report.add(f"{doc.where()}: {doc.ident}: {field_path(parts)}: {message}")
        for problem in check_build(objects, everything):
            report.add(problem)
    _check_rule_files(sorted(set(loader.rule_files)), loader, report)
    _check_dashboards(everything, report)
    return report
