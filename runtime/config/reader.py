"""Reading a config file: YAML with every mapping's keys unique (plain YAML keeps the last of
a repeated key silently; a config must not)."""

from __future__ import annotations

import os

from runtime.errors import ConfigError


def _unique_key_loader():
    """A yaml SafeLoader that refuses a mapping holding one key twice (plain YAML keeps the
    last silently), naming the dotted key and both lines: ConfigError."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_document(self, node):
            _check_unique_keys(node, "", set())
            return super().construct_document(node)

    return UniqueKeyLoader


def _check_unique_keys(node, prefix: str, seen_nodes: set) -> None:
    import yaml

    if id(node) in seen_nodes:  # an alias of a node already checked
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(item, f"{prefix}[{i}]", seen_nodes)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
            if key in lines:
                where = (
                    f"twice on line {line}"
                    if lines[key] == line
                    else f"lines {lines[key]} and {line}"
                )
                raise ConfigError(
                    key, f"duplicate key ({where}); each key may appear once in a mapping"
                )
            lines[key] = line
            _check_unique_keys(value_node, f"{key}.", seen_nodes)


def read_yaml(path: str) -> dict:
    """The top-level mapping of the YAML file at `path`; ConfigError for a missing or
    unreadable file or a top level that is no mapping (its key: the file's path, so the
    message starts with it), or for a duplicate key (its key: the duplicated key)."""
    import yaml

    if not os.path.isfile(path):
        what = "is a directory, not a config file" if os.path.isdir(path) else "does not exist"
        raise ConfigError(path, f"the config file {what}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f, Loader=_unique_key_loader())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(path, f"cannot read the config file as YAML: {e}") from e
    if not isinstance(raw, dict):
        what = "empty" if raw is None else f"a {type(raw).__name__}"
        raise ConfigError(
            path,
            f"the config file's top level must be a mapping (draft:, target:, ...), "
            f"but it is {what}",
        )
    return raw
