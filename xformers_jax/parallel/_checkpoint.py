"""Orbax checkpoints keyed by tree path, restored onto any mesh.

On disk, a checkpoint is orbax's pytree format (``StandardSave``) of a nested dict: the array
leaves of a state (an Equinox module, optax state, any pytree) keyed by the components of their
tree paths (:func:`path_string`). The leaf ``state.model.layers[0].attn.wq`` is stored at
``{"model": {"layers": {"0": {"attn": {"wq": ...}}}}}`` and listed as
``"model/layers/0/attn/wq"``; sequence indices become the strings ``"0"``, ``"1"``, ... .
Non-array leaves (hyperparameters, activation functions, Python numbers) are static: they are
not stored and come from the template on restore.

Restoring reads the checkpoint's tree metadata first (paths, shapes, dtypes; no array data) and
compares it with the template's array paths: a path missing on either side, or stored with
another shape or dtype, raises ``ValueError`` naming the first such path before any array is
read. Arrays are matched by name, so a model whose fields were reordered still loads each array
into its own field, and a renamed or added field fails instead of loading another's weights.

Each process writes the shards it holds (one process on a single host); restoring with target
shardings reads each target shard's slice of the stored array, so a state saved on a ``(4, 2)``
mesh can be read onto a ``(2, 4)`` mesh or one device.

Keys: orbax names each array by joining its dict keys with ``"."``, so ``{"a.b": x}`` and
``{"a": {"b": y}}`` would be one array on disk (orbax then silently reads one value for both).
Saving therefore refuses a path component that is empty or contains ``"."`` or ``"/"`` (the
separator of :func:`path_string`), naming the path; attribute names and sequence indices never
do, only unusual dict keys.

Index-keyed checkpoints: before this format, arrays were stored by leaf index (``{"00000":
..., "00001": ...}`` here, ``{"0": ..., "1": ...}`` by ``train.Checkpointer``). An index cannot
say which field an array belongs to, so restoring one raises ``ValueError`` pointing to
:func:`convert_index_checkpoint`, which rewrites it by path once, given a template in the field
order of the code that wrote it.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import equinox as eqx
import jax
import orbax.checkpoint as ocp
from etils import epath

from ._rules import path_string

Path = tuple[str, ...]  # a leaf's path components, e.g. ("model", "layers", "0", "wq")

_TREE_METADATA = "_METADATA"  # the file orbax writes beside a pytree checkpoint's arrays


def _show(path: Path) -> str:
    return "/".join(path) if path else "<root>"


def _spec(x) -> str:
    return f"{jax.numpy.dtype(x.dtype).name}{list(x.shape)}"


def _is_template_array(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _components(path) -> Path:
    """A jax key path as checkpoint keys (each a :func:`path_string` component), checked."""
    parts = tuple(path_string((k,)) for k in path)
    if not parts:
        raise ValueError("checkpoint: the state is a bare array; put it in a pytree (e.g. a dict) "
                         "so that it has a path to be stored under")
    for part in parts:
        if part == "" or "." in part or "/" in part:
            raise ValueError(
                f"checkpoint: the leaf at {'/'.join(parts)!r} has the path component {part!r}; "
                "components must be non-empty and contain neither '.' (orbax joins keys with "
                "'.', so it would collide with nested keys) nor '/' (the path separator)")
    return parts


def _arrays_by_path(state, is_array=eqx.is_array) -> dict[Path, Any]:
    """``{path: leaf}`` for the array leaves of ``state``, in its flattening order."""
    out: dict[Path, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not is_array(leaf):
            continue
        key = _components(path)
        if key in out:
            raise ValueError(f"checkpoint: two leaves of the state have the path {_show(key)!r} "
                             f"(dict keys that print alike, e.g. 0 and '0')")
        out[key] = leaf
    return out


def _nest(flat: dict[Path, Any]) -> dict:
    """``{("a", "b"): x}`` -> ``{"a": {"b": x}}`` (the tree orbax stores)."""
    tree: dict = {}
    for path, x in flat.items():
        node = tree
        for i, k in enumerate(path[:-1]):
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"checkpoint: {_show(path[:i + 1])!r} is both an array and a "
                                 f"prefix of {_show(path)!r}")
        if path[-1] in node:
            raise ValueError(f"checkpoint: {_show(path)!r} is both an array and a prefix of "
                             "other paths")
        node[path[-1]] = x
    return tree


def checkpoint_tree(state) -> dict:
    """The nested dict that is saved for ``state``: its array leaves keyed by path."""
    return _nest(_arrays_by_path(state))


def _flat_metadata(tree, prefix: Path = ()) -> dict[Path, jax.ShapeDtypeStruct]:
    """Orbax's stored tree metadata as ``{path: ShapeDtypeStruct(shape, dtype)}``."""
    out: dict[Path, jax.ShapeDtypeStruct] = {}
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return {prefix: jax.ShapeDtypeStruct(tuple(tree.shape), tree.dtype)}
    for k, v in items:
        out.update(_flat_metadata(v, prefix + (str(k),)))
    return out


def _index_keyed(stored: dict[Path, Any]) -> bool:
    """Whether the stored keys are the old leaf indices: "0", "1", ... or "00000", ... ."""
    n = len(stored)
    keys = set(stored)
    return n > 0 and (keys == {(str(i),) for i in range(n)}
                      or keys == {(f"{i:05d}",) for i in range(n)})


def _index_error(where: str, n: int) -> ValueError:
    return ValueError(
        f"{where} is keyed by leaf index ({n} arrays stored as '0', '1', ... or '00000', ...), "
        "the format written before checkpoints were keyed by tree path; an index cannot tell "
        "which field an array belongs to. Convert it once with "
        "xformers_jax.parallel.convert_index_checkpoint(old_dir, new_dir, template), the "
        "template having the field order of the code that wrote the checkpoint, and restore "
        "from new_dir.")


def _check_structure(expected: dict[Path, Any], stored: dict[Path, Any], where: str) -> None:
    """Raises ``ValueError`` naming the first path where the template and checkpoint differ.

    ``expected`` is in the template's flattening order (its first difference is reported
    first); a path missing from the checkpoint, stored with another shape or dtype, or stored
    but absent from the template are all differences.
    """
    missing = [p for p in expected if p not in stored]
    extra = [p for p in stored if p not in expected]
    if (missing or extra) and _index_keyed(stored):
        raise _index_error(where, len(stored))
    for p, want in expected.items():
        have = stored.get(p)
        if have is None:
            hint = (f"; the checkpoint has {_show(extra[0])!r} ({_spec(stored[extra[0]])}), "
                    "which the template lacks" if extra else "")
            raise ValueError(
                f"{where}: the template has an array at {_show(p)!r} ({_spec(want)}) that the "
                f"checkpoint lacks{hint} ({len(missing)} template paths missing from the "
                f"checkpoint, {len(extra)} stored paths not in the template): the model's "
                "structure differs from the one saved")
        if tuple(have.shape) != tuple(want.shape):
            raise ValueError(
                f"{where}: the array at {_show(p)!r} is stored with shape {tuple(have.shape)} "
                f"but the template's has shape {tuple(want.shape)}")
        if jax.numpy.dtype(have.dtype) != jax.numpy.dtype(want.dtype):
            raise ValueError(
                f"{where}: the array at {_show(p)!r} is stored as {_spec(have)} but the "
                f"template's is {_spec(want)}")
    if extra:
        raise ValueError(
            f"{where}: the checkpoint has an array at {_show(extra[0])!r} "
            f"({_spec(stored[extra[0]])}) that the template lacks ({len(extra)} such paths): "
            "the model's structure differs from the one saved")


def _sharding_by_path(paths: list[Path], shardings) -> dict[Path, jax.sharding.Sharding]:
    """One sharding per array path: ``shardings`` is None (one local device), one ``Sharding``
    for all, or a tree whose ``Sharding`` leaves sit at the arrays' paths or at a prefix of
    them (e.g. ``ShardingPlan.state``, ``param_shardings(...)``, ``(p_sh, o_sh)``)."""
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return {p: device for p in paths}
    given: dict[Path, jax.sharding.Sharding] = {}
    flat = jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))[0]
    for path, s in flat:
        key = tuple(path_string((k,)) for k in path)
        if not isinstance(s, jax.sharding.Sharding):
            raise ValueError(f"shardings: the leaf at {_show(key)!r} is a {type(s).__name__}, "
                             "not a jax.sharding.Sharding")
        given[key] = s
    out, used = {}, set()
    for p in paths:
        for n in range(len(p), -1, -1):
            if p[:n] in given:
                out[p] = given[p[:n]]
                used.add(p[:n])
                break
        else:
            raise ValueError(f"shardings: no sharding for the template's array at {_show(p)!r} "
                             "(give one at its path or at a prefix of it)")
    unused = [k for k in given if k not in used]
    if unused:
        raise ValueError(f"shardings: the sharding at {_show(unused[0])!r} matches no array of "
                         "the template")
    return out


def restore_target(like, stored_tree, shardings, where: str) -> dict:
    """The checked abstract tree to restore ``like``'s arrays from a checkpoint.

    Args:
      like: the template (arrays or ``jax.ShapeDtypeStruct`` leaves give shapes and dtypes).
      stored_tree: the checkpoint's tree metadata (``TreeMetadata.tree``: nested dicts of
        array metadata) or the part of it to restore from.
      shardings: see :func:`_sharding_by_path`.
      where: the checkpoint, for messages.

    Returns:
      A nested dict of ``jax.ShapeDtypeStruct`` with target shardings, keyed like the stored
      tree. Raises ``ValueError`` when the structures differ (see :func:`_check_structure`).
    """
    expected = _arrays_by_path(like, _is_template_array)
    _check_structure(expected, _flat_metadata(stored_tree), where)
    placed = _sharding_by_path(list(expected), shardings)
    return _nest({p: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=placed[p])
                  for p, x in expected.items()})


def fill_arrays(like, restored: dict):
    """``like`` with each array leaf replaced by the restored array at its path."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    values = []
    for path, leaf in leaves:
        if _is_template_array(leaf):
            node = restored
            for k in _components(path):
                node = node[k]
            leaf = node
        values.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, values)


def _prefix(prefix: str | None) -> Path:
    return tuple(p for p in (prefix or "").split("/") if p)


def _stored_metadata(directory: str) -> dict:
    """The checkpoint's stored tree (nested dicts of array metadata), read without arrays."""
    path = epath.Path(directory)
    if not (path / _TREE_METADATA).exists():
        raise ValueError(
            f"{directory} is not an orbax pytree checkpoint (no {_TREE_METADATA} file); a "
            "train.Checkpointer step keeps its arrays in <workdir>/checkpoints/<step>/state "
            "(or best/<step>/state)")
    return ocp.StandardCheckpointHandler().metadata(path).tree


def save_checkpoint(directory: str, state) -> None:
    """Saves the array leaves of ``state`` under ``directory`` (which must not exist yet),
    keyed by their tree paths (see the module docstring for the layout)."""
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(directory), checkpoint_tree(state))
        ckpt.wait_until_finished()


def checkpoint_contents(directory: str) -> dict[str, jax.ShapeDtypeStruct]:
    """What a checkpoint holds, from its metadata alone (no array is read).

    Args:
      directory: a :func:`save_checkpoint` directory, or the ``state`` item of a
        ``train.Checkpointer`` step (``<workdir>/checkpoints/<step>/state``).

    Returns:
      ``{path: jax.ShapeDtypeStruct(shape, dtype)}`` in the stored order, paths written as
      :func:`path_string` writes them (``"model/layers/0/attn/wq"``). An index-keyed
      checkpoint lists ``"0"``, ``"1"``, ... (or ``"00000"``, ...).
    """
    directory = os.path.abspath(directory)
    return {"/".join(p): s for p, s in _flat_metadata(_stored_metadata(directory)).items()}


def restore_checkpoint(directory: str, like, shardings=None, *, prefix: str | None = None):
    """Restores the arrays of ``like``'s structure, by path, from a checkpoint.

    Args:
      directory: a :func:`save_checkpoint` directory (or a ``train.Checkpointer`` step's
        ``state`` item, ``<workdir>/checkpoints/<step>/state``).
      like: a state of the checkpoint's structure (e.g. freshly initialised, or
        ``eqx.filter_eval_shape`` of the initialiser: ``jax.ShapeDtypeStruct`` leaves count as
        arrays; plain ``jax.eval_shape`` would also make Python numbers abstract arrays); only
        its arrays' paths, shapes and dtypes and its static parts are used.
      shardings: where to place the arrays: None (one local device), one ``Sharding`` for all,
        or a tree with a ``Sharding`` at each array's path of ``like`` or at a prefix of it (as
        :func:`param_shardings` / :func:`optimizer_shardings` give); any mesh, whatever mesh
        wrote the checkpoint.
      prefix: restore only the arrays stored under this path (e.g. ``"model"`` from a train
        state, ``"0"`` from a saved ``(model, opt_state)`` pair), into ``like`` of that
        subtree's structure; other arrays are not read.

    Returns:
      ``like`` with every array replaced by the stored one, placed with ``shardings``.

    Raises:
      ValueError: before reading any array, when the checkpoint (under ``prefix``) and ``like``
        differ in a path, shape or dtype (the message names the first such path), or when the
        checkpoint is keyed by leaf index (convert it with :func:`convert_index_checkpoint`).
    """
    directory = os.path.abspath(directory)
    stored = _stored_metadata(directory)
    where = directory
    pre = _prefix(prefix)
    for i, k in enumerate(pre):
        if not isinstance(stored, dict) or k not in stored:
            keys = sorted(stored) if isinstance(stored, dict) else []
            raise ValueError(f"{directory} holds no array under {_show(pre[:i + 1])!r}; "
                             f"there it has {keys}")
        stored = stored[k]
        where = f"{directory} under {_show(pre)!r}"
    target = restore_target(like, stored, shardings, where)
    for k in reversed(pre):
        target = {k: target}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckpt:
        restored = ckpt.restore(directory, args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=bool(pre)))
    for k in pre:
        restored = restored[k]
    return fill_arrays(like, restored)


def convert_index_checkpoint(old_dir: str, new_dir: str, template) -> list[str]:
    """Rewrites checkpoints keyed by leaf index as checkpoints keyed by tree path.

    Works on a :func:`save_checkpoint` directory, one ``train.Checkpointer`` step, or a whole
    run's ``workdir``: every orbax pytree under ``old_dir`` whose keys are leaf indices is
    rewritten by path under the same relative place in ``new_dir``; everything else (the data
    iterator's JSON, orbax's step metadata) is copied as it is. The index checkpoints are read
    onto one device, one at a time.

    Args:
      old_dir: the index-keyed checkpoint(s).
      new_dir: where to write; must not exist.
      template: a state whose array leaves are in the order of the code that WROTE the
        checkpoint (leaf ``i`` of ``template`` receives stored array ``i``): the index holds no
        other clue. Shapes and dtypes are checked per index, which catches most but not all
        reorderings (same-shaped arrays cannot be told apart).

    Returns:
      The converted pytree directories under ``new_dir``.
    """
    old_dir, new_dir = os.path.abspath(old_dir), os.path.abspath(new_dir)
    if os.path.exists(new_dir):
        raise ValueError(f"convert_index_checkpoint: {new_dir} already exists")
    items = []
    for dirpath, _, files in os.walk(old_dir):
        if _TREE_METADATA in files and _index_keyed(_flat_metadata(_stored_metadata(dirpath))):
            items.append(dirpath)
    if not items:
        raise ValueError(f"convert_index_checkpoint: no index-keyed orbax checkpoint under "
                         f"{old_dir}")
    skip = set(items)
    if old_dir not in skip:
        shutil.copytree(old_dir, new_dir, ignore=lambda d, names: [
            n for n in names if os.path.join(d, n) in skip])
    expected = _arrays_by_path(template, _is_template_array)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    converted = []
    for item in items:
        stored = _flat_metadata(_stored_metadata(item))
        keys = sorted(stored, key=lambda p: int(p[0]))
        if len(keys) != len(expected):
            raise ValueError(f"convert_index_checkpoint: {item} holds {len(keys)} arrays but "
                             f"the template has {len(expected)}")
        for key, (path, want) in zip(keys, expected.items()):
            have = stored[key]
            if (tuple(have.shape) != tuple(want.shape)
                    or jax.numpy.dtype(have.dtype) != jax.numpy.dtype(want.dtype)):
                raise ValueError(
                    f"convert_index_checkpoint: {item}: stored array {int(key[0])} is "
                    f"{_spec(have)} but "
                    f"the template's array {int(key[0])}, at {_show(path)!r}, is {_spec(want)}: "
                    "the template's arrays are not in the order of the code that wrote it")
        target = {k[0]: jax.ShapeDtypeStruct(tuple(stored[k].shape), stored[k].dtype,
                                             sharding=device) for k in keys}
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(item, target)
        by_path = {path: restored[k[0]] for k, path in zip(keys, expected)}
        out = os.path.join(new_dir, os.path.relpath(item, old_dir))
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(os.path.normpath(out), _nest(by_path))
            ckpt.wait_until_finished()
        converted.append(os.path.normpath(out))
    return converted
