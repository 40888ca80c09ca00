"""adtape's modules import one way: each imports first in a fresh interpreter, none imports
below its code, the imports at module level form no cycle, and Tensor's operators are
assigned in one place (adtape._operators, imported last by adtape/__init__)."""
import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "adtape"


def _python_modules():
    """Module name -> path of every .py file of adtape, its subpackages included."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _python_modules()
COMPILED = sorted(f"adtape.{path.stem}" for path in PACKAGE.glob("*.pyx"))
KNOWN = set(MODULES) | set(COMPILED)


def _is_import(node):
    """An import statement, or a ``try`` of imports only (adtape/__init__'s import of the
    compiled core, which explains what is missing when it fails)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    return isinstance(node, ast.Try) and all(_is_import(n) for n in node.body)


def _module_level_imports(nodes):
    """The import statements that run when the module is imported: those outside function
    bodies (inside ``if``, ``try``, ``with`` or a class body they still run)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _module_level_imports(ast.iter_child_nodes(node))


def _body(path):
    body = ast.parse(path.read_text(), str(path)).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]         # the docstring
    return body


def _imported_modules(name, node):
    """The adtape modules an import statement of module ``name`` names."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        # `from adtape.numpy import linalg` names the submodule, `from adtape.numpy import
        # sin` the package.
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in KNOWN else base
                   for alias in node.names]
    return {t for t in targets if t in MODULES}


# Run in a fresh interpreter that has loaded NumPy and SciPy (most of the start-up time)
# and no adtape module: a forked child per module imports it first, then checks that
# Tensor has its operators whichever module came first.
_IMPORT_EACH_FIRST = """
import os, sys, traceback
import numpy, scipy.linalg, scipy.special
assert not [m for m in sys.modules if m.split(".")[0] == "adtape"]
failed = []
for module in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            __import__(module)
            from adtape.tensor import Tensor
            t = Tensor([1.0, 2.0], requires_grad=True)
            assert (t + 1).data.tolist() == [2.0, 3.0] and (t < 2).tolist() == [True, False]
            assert type(numpy.sin(t)) is Tensor and (t.T @ t).data == 5.0
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1] != 0:
        failed.append(module)
print(" ".join(failed))
"""


def test_each_module_imports_first_in_a_fresh_interpreter(tmp_path):
    import adtape
    modules = sorted(MODULES) + COMPILED
    # The installed package, run from outside the source tree (whose unbuilt adtape
    # "-c" would put first on sys.path).
    installed = os.path.dirname(os.path.dirname(adtape.__file__))
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH_FIRST, *modules], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=installed),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and not done.stdout.strip(), (
        f"these modules fail to import first: {done.stdout.strip()}\n{done.stderr}")


def test_no_module_imports_below_its_code():
    late = []
    for name, path in MODULES.items():
        body = _body(path)
        first_code = next((i for i, node in enumerate(body) if not _is_import(node)), len(body))
        late += [f"{path.relative_to(ROOT)}:{node.lineno}"
                 for node in _module_level_imports(body[first_code:])]
    assert not late, f"imports below the module's first statement of code: {late}"


def test_module_level_imports_form_no_cycle():
    graph = {name: set().union(*[_imported_modules(name, node)
                                 for node in _module_level_imports(_body(path))])
             for name, path in MODULES.items()}
    # adtape/__init__ imports its modules and each of them, imported, runs it first; a
    # module that imported adtape itself back would be a cycle, and is one here.
    done, path = set(), []

    def visit(name):
        if name in path:
            cycle = path[path.index(name):] + [name]
            pytest.fail(f"import cycle: {' -> '.join(cycle)}")
        if name in done:
            return
        path.append(name)
        for target in sorted(graph[name]):
            visit(target)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    assert "adtape.vjps" not in graph["adtape.tensor"]
    assert "adtape.numpy" not in graph["adtape.tensor"]


def test_tensor_operators_are_assigned_in_one_module():
    assigning = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "Tensor"):
                    assigning.add(name)
    assert assigning == {"adtape._operators"}
    init = _body(MODULES["adtape"])
    last_import = [node for node in init if _is_import(node)][-1]
    assert _imported_modules("adtape", last_import) == {"adtape._operators"}
