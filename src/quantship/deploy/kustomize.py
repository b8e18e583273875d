"""Just enough of `kustomize build` to validate what an overlay produces, offline and without the
kustomize binary: `resources` (files and directories), `namespace`, and `patches` made of JSON 6902
operations (add, replace, remove, test) picked by target kind/name. The Kustomization schema refuses
every other kustomize feature, so nothing is silently skipped.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from quantship.files import load_yaml


@dataclass
class Doc:
    """One Kubernetes object and where it came from, for messages that name the file."""

    file: Path
    data: dict
    origin: str = ""
    patched_by: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return str(self.data.get("kind", "?"))

    @property
    def name(self) -> str:
        return str((self.data.get("metadata") or {}).get("name", "?"))

    @property
    def ident(self) -> str:
        return f"{self.kind}/{self.name}"

    def where(self) -> str:
        return self.origin + (f" (patched by {', '.join(self.patched_by)})" if self.patched_by else "")


class PatchError(Exception):
    pass


def _pointer(path: str) -> list[str]:
    if not isinstance(path, str) or not path.startswith("/"):
        raise PatchError(f"path {path!r} is not a JSON pointer")
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def _walk(node, parts: list[str]):
    for part in parts:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise PatchError(f"/{'/'.join(parts)} does not exist") from None
    return node


def apply_operation(data: dict, op: dict) -> None:
    if not isinstance(op, dict) or op.get("op") not in ("add", "replace", "remove", "test"):
        raise PatchError(f"unsupported operation {op!r} (add, replace, remove, test)")
    parts = _pointer(op.get("path"))
    if not parts:
        raise PatchError("cannot patch the whole object")
    parent, key = _walk(data, parts[:-1]), parts[-1]
    kind = op["op"]
    if isinstance(parent, list):
        if kind == "add" and key == "-":
            parent.append(op.get("value"))
            return
        try:
            index = int(key)
        except ValueError:
            raise PatchError(f"{op['path']}: {key!r} is not a list index") from None
        exists = 0 <= index < len(parent)
    elif isinstance(parent, dict):
        index, exists = key, key in parent
    else:
        raise PatchError(f"{op['path']}: parent is not an object or list")
    if kind != "add" and not exists:
        raise PatchError(f"{op['path']} does not exist")
    if kind == "test":
        if parent[index] != op.get("value"):
            raise PatchError(f"test failed at {op['path']}")
    elif kind == "remove":
        del parent[index]
    elif kind == "add" and isinstance(parent, list):
        parent.insert(index, op.get("value"))
    else:
        parent[index] = copy.deepcopy(op.get("value"))


def _matches(doc: Doc, target: dict) -> bool:
    api = str(doc.data.get("apiVersion", ""))
    group, _, version = api.rpartition("/")
    return (doc.kind == target.get("kind")
            and target.get("name") in (None, doc.name)
            and target.get("group") in (None, group)
            and target.get("version") in (None, version))


def build(kfile: Path, load, show=str, stack: tuple = ()) -> tuple[list[Doc], list[str]]:
    """(objects, problems). `load(path)` returns the Docs of a file (the validator's cache); `show(path)`
    spells a path for messages."""
    problems: list[str] = []
    name = show(kfile)
    if kfile in stack:
        return [], [f"{name}: resources form a cycle"]
    docs = [d for d in load(kfile) if d.kind == "Kustomization"]
    if not docs:
        return [], [f"{name}: not a Kustomization"]
    k = docs[0].data
    objects: list[Doc] = []
    for i, res in enumerate(k.get("resources") or []):
        path = (kfile.parent / str(res)).resolve()
        if path.is_dir():
            sub = next((path / n for n in ("kustomization.yaml", "kustomization.yml", "Kustomization")
                        if (path / n).is_file()), None)
            if sub is None:
                problems.append(f"{name}: resources[{i}]: {res} is a directory without a kustomization.yaml")
                continue
            sub_objects, sub_problems = build(sub.resolve(), load, show, stack + (kfile,))
            objects += sub_objects
            problems += sub_problems
        elif path.is_file():
            objects += [Doc(d.file, copy.deepcopy(d.data), d.origin) for d in load(path) if d.kind != "Kustomization"]
        else:
            problems.append(f"{name}: resources[{i}]: {res} not found")
    for i, patch in enumerate(k.get("patches") or []):
        problems += _patch(kfile, name, i, patch, objects)
    if k.get("namespace"):
        for d in objects:
            d.data.setdefault("metadata", {})["namespace"] = k["namespace"]
    return objects, problems


def _patch(kfile: Path, name: str, i: int, patch: dict, objects: list[Doc]) -> list[str]:
    where = f"{name}: patches[{i}]"
    try:
        text = patch["patch"] if "patch" in patch else (kfile.parent / patch["path"]).read_text(encoding="utf-8")
        ops = load_yaml(text)
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        return [f"{where}: unreadable patch ({exc})"]
    if not isinstance(ops, list):
        return [f"{where}: only JSON 6902 patches (a list of operations) are supported"]
    target = patch.get("target") or {}
    chosen = [d for d in objects if _matches(d, target)]
    if not chosen:
        return [f"{where}.target: no {target.get('kind')}/{target.get('name', '*')} in the resources"]
    problems = []
    for doc in chosen:
        try:
            for op in ops:
                apply_operation(doc.data, op)
            doc.patched_by.append(name)
        except PatchError as exc:
            problems.append(f"{where}: {doc.ident}: {exc}")
    return problems
