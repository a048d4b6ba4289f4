"""The import graph: layers point one way, and modules form a DAG.

Reads every module of the project with ``ast`` (imports inside functions included) and checks
that no module imports a higher layer and that no import cycle exists module by module, so
the kernel layer can be read, tested and reused without what is built on it. A package's
``__init__`` is a module like any other: its imports of its children are edges, so a child
importing its own package back closes a cycle.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("xformers_jax", "pallas_kernels")

# Lowest first. A module may import modules of its own layer or of a lower one.
LAYERS = (
    ("xformers_jax.axes", "xformers_jax.kinds"),
    ("xformers_jax.kernels",),
    ("pallas_kernels",),
    ("xformers_jax.attention", "xformers_jax.experts", "xformers_jax.mixers"),
    ("xformers_jax.data",),
    ("xformers_jax.nn",),
    ("xformers_jax.models",),
    ("xformers_jax.compress",),
    ("xformers_jax.parallel",),
    ("xformers_jax.train", "xformers_jax.viz", "xformers_jax"),
)


def _modules(root=ROOT, packages=PACKAGES):
    """``{dotted name: (path, is_package)}`` for every module of ``packages`` under ``root``."""
    mods = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            mods[".".join(parts)] = (path, is_pkg)
    return mods


def _imports(name, path, is_pkg, known):
    out = set()
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _layer(module):
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (rank, len(p))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def _graph(root=ROOT, packages=PACKAGES):
    """``{module: the modules it imports}`` for ``packages`` under ``root``."""
    mods = _modules(root, packages)
    return {m: _imports(m, p, is_pkg, mods) for m, (p, is_pkg) in mods.items()}


def _find_cycle(graph):
    """An import cycle of ``graph`` as a closed path ``[a, b, ..., a]``, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                cycle = visit(t)
                if cycle:
                    return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            if cycle:
                return cycle
    return None


def test_no_module_imports_a_higher_layer():
    bad = [f"{m} -> {t}" for m, ts in _graph().items() for t in ts
           if not m.endswith("__init__") and _layer(t) > _layer(m)
           and not t.startswith(m + ".")]
    assert not bad, "imports pointing up a layer:\n" + "\n".join(sorted(bad))


def test_kernel_layer_imports_nothing_of_the_project_above_it():
    graph = _graph()
    for m, ts in graph.items():
        if m.startswith(("xformers_jax.kernels", "pallas_kernels")):
            up = {t for t in ts if not t.startswith(("xformers_jax.kernels", "pallas_kernels"))
                  and t != "xformers_jax"}
            assert not up, f"{m} imports {sorted(up)}"


def test_kinds_imports_nothing_of_the_project():
    # Every layer declares kinds (xformers_jax.kinds.Kind), so the record type stands alone.
    assert _graph()["xformers_jax.kinds"] == set()


def test_modules_form_a_dag():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _write(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_cycle_check_sees_package_edges(tmp_path):
    # A tree without a cycle: a package re-exports its children, a child imports a sibling.
    _write(tmp_path, {"clean/__init__.py": "from .a import f\nfrom .b import g\n",
                      "clean/a.py": "def f(): ...\n",
                      "clean/b.py": "from .a import f\n\ndef g(): ...\n"})
    assert _find_cycle(_graph(tmp_path, ("clean",))) is None
    # A package whose __init__ imports a child that imports the package back.
    _write(tmp_path, {"pkg/__init__.py": "from . import child\nVALUE = 1\n",
                      "pkg/child.py": "from pkg import VALUE\n"})
    assert _find_cycle(_graph(tmp_path, ("pkg",))) == ["pkg", "pkg.child", "pkg"]
    # A registration circle: the registry imports a sub-package of entries, whose child
    # imports the registry to register itself (nn/_registry -> nn/_variants/* -> nn/_registry).
    _write(tmp_path, {"reg/__init__.py": "from ._registry import register\n",
                      "reg/_registry.py": "def register(x): ...\n\nfrom . import _variants\n",
                      "reg/_variants/__init__.py": "from . import _exact\n",
                      "reg/_variants/_exact.py": "from .._registry import register\n"})
    assert _find_cycle(_graph(tmp_path, ("reg",))) == [
        "reg._registry", "reg._variants", "reg._variants._exact", "reg._registry"]
