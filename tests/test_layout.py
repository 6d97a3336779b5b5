"""The code's shape: one import root, dependencies one way, no giant function or class.

Layers, lowest first: ``raymq.storage`` <- ``raymq.actors`` (the broker) <- the
client (``raymq`` itself) <- ``raymq.tools`` and ``raymq.jobs``.  A module may
import its own layer and those below, never one above.  Walks the sources with
``ast`` (nothing is imported).
"""
from __future__ import annotations

import ast
import os
import sys

import pytest
from tests.helpers import ROOT

#: repository folder -> the package it installs as
FOLDERS = {"storage": "raymq.storage", "actors": "raymq.actors", "jobs": "raymq.jobs",
           "cluster": "raymq"}
LAYERS = ["raymq.storage", "raymq.actors", "raymq", "raymq.tools"]  # jobs: as high as tools
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 400


def modules() -> dict[str, str]:
    """Dotted module name -> path, for every module of ours."""
    out = {}
    for folder, package in FOLDERS.items():
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, folder)):
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            pkg = package if rel == "." else package + "." + rel.replace(os.sep, ".")
            for f in files:
                if f.endswith(".py"):
                    name = pkg if f == "__init__.py" else f"{pkg}.{f[:-3]}"
                    out[name] = os.path.join(dirpath, f)
    return out


def layer(module: str) -> int:
    """The layer of a module of ours: the index in LAYERS of its longest matching prefix."""
    if module == "raymq.jobs" or module.startswith("raymq.jobs."):
        return LAYERS.index("raymq.tools")
    best = None
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(LAYERS[best]):
                best = i
    assert best is not None, module
    return best


def imported(path: str, module: str) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, relative ones resolved."""
    tree = ast.parse(open(path).read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.rsplit(".", node.level)[0]
                base = f"{parent}.{base}" if base else parent
            # ``from raymq import transaction_producer`` imports a module of that package
            out += [(node.lineno, f"{base}.{a.name}" if base == "raymq" else base)
                    for a in node.names]
    return out


def test_every_import_of_ours_goes_through_the_raymq_root():
    wrong = [f"{os.path.relpath(path, ROOT)}:{line}: import {name}"
             for module, path in modules().items()
             for line, name in imported(path, module)
             if name.split(".")[0] in FOLDERS]
    assert wrong == []


def test_dependencies_run_one_way():
    """storage <- actors <- client <- tools/jobs; no module of storage imports Ray."""
    wrong = []
    for module, path in modules().items():
        mine = layer(module)
        for line, name in imported(path, module):
            where = f"{os.path.relpath(path, ROOT)}:{line}"
            if name == "raymq" or name.startswith("raymq."):
                if layer(name) > mine:
                    wrong.append(f"{where}: {module} imports {name} (a higher layer)")
            elif name.split(".")[0] == "ray" and mine <= LAYERS.index("raymq.actors"):
                wrong.append(f"{where}: {module} imports Ray (storage and broker are Ray-free)")
    assert wrong == []


#: The walk of a replicated send: client -> channel -> replica -> shard -> store.
REPLICATION = "raymq.actors.replication"


def test_the_replicated_walk_runs_forward():
    """Replication is one package: the shard and its parts, the channel and the store never
    import it (they come after it in the walk); only the controller (whose groups'
    side it holds) and the layers above the broker do."""
    wrong = []
    for module, path in modules().items():
        if module.startswith(REPLICATION) or module == "raymq.actors.controller" or \
                layer(module) > LAYERS.index("raymq.actors"):
            continue
        for line, name in imported(path, module):
            if name == REPLICATION or name.startswith(REPLICATION + "."):
                wrong.append(f"{os.path.relpath(path, ROOT)}:{line}: {module} imports {name}")
    assert wrong == []


def test_the_layer_check_sees_a_wrong_way_import(tmp_path):
    """The walk above would catch a broker module importing the client."""
    bad = tmp_path / "bad.py"
    bad.write_text("from raymq.producer import Producer\nimport ray\n")
    names = [n for _l, n in imported(str(bad), "raymq.actors.bad")]
    assert names == ["raymq.producer", "ray"]
    assert layer("raymq.producer") > layer("raymq.actors.bad")
    assert layer("raymq.tools.cli") > layer("raymq.client") > layer("raymq.actors.shard") \
        > layer("raymq.storage.store")


def sizes(kind) -> list[tuple[int, str]]:
    """(lines, where) of every function or class in the broker and storage layers."""
    out = []
    for module, path in modules().items():
        if layer(module) > LAYERS.index("raymq.actors"):
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, kind):
                out.append((node.end_lineno - node.lineno + 1,
                            f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name}"))
    return sorted(out, reverse=True)


def test_no_function_over_60_lines_in_broker_and_storage():
    largest = sizes((ast.FunctionDef, ast.AsyncFunctionDef))
    print("largest functions:", largest[:3], file=sys.stderr)
    assert [s for s in largest if s[0] > MAX_FUNCTION_LINES] == []


def test_no_class_over_400_lines_in_broker_and_storage():
    largest = sizes(ast.ClassDef)
    print("largest classes:", largest[:3], file=sys.stderr)
    assert [s for s in largest if s[0] > MAX_CLASS_LINES] == []


@pytest.mark.parametrize("module", sorted(modules()))
def test_every_module_says_what_it_owns(module):
    doc = ast.get_docstring(ast.parse(open(modules()[module]).read()))
    assert doc and doc.strip(), f"{module} has no docstring saying what it owns"



def error_classes_defined() -> dict[str, list[str]]:
    """Class name -> modules defining it, for every class whose name ends in ``Error``."""
    found: dict[str, list[str]] = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                found.setdefault(node.name, []).append(name)
    return found


def test_every_error_is_one_class_in_one_place_exported_from_raymq():
    """One hierarchy: every error class lives in ``raymq.storage.errors`` (a caller
    catches what any layer raises without importing that layer) and ``raymq`` exports it."""
    import importlib

    import raymq
    found = {n: where for n, where in error_classes_defined().items()  # (a module's own
             if any(issubclass(getattr(importlib.import_module(m), n), raymq.RayMQError)
                    for m in where)}                              # internal signals aside)
    assert "RequestTimeoutError" in found and "NotDeployedError" in found
    assert {n: m for n, m in found.items() if m != ["raymq.storage.errors"]} == {}
    assert sorted(n for n in found if n not in raymq.__all__) == []

@pytest.mark.slow
def test_the_wheel_installs_one_top_level_package(tmp_path):
    """Nothing but ``raymq`` (and its metadata) lands at the top of site-packages."""
    import subprocess
    import zipfile
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                    str(tmp_path), ROOT], check=True, capture_output=True, timeout=600)
    [wheel] = list(tmp_path.glob("raymq-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"raymq", wheel.name.split("-py3")[0] + ".dist-info"}
    assert {"raymq/__init__.py", "raymq/actors/shard.py", "raymq/storage/store.py",
            "raymq/tools/cli.py", "raymq/jobs/__init__.py"} <= set(names)
