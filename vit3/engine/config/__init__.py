"""Run configs: files and overrides (:mod:`.load`), the table of what each key allows (:mod:`.schema`), the
kinds of constraint and their wording (:mod:`.kinds`), and the tests of values and paths the table runs
(:mod:`.value_checks`, :mod:`.path_checks`). The rest of vit3 imports from here."""

from ...errors import ConfigError
from .kinds import FLAGS, config_value, key_name
from .load import (
    COMMAND_KEYS,
    CONFIG_DIR,
    DEFAULT_CONFIG,
    NULLABLE,
    TASK_CONFIGS,
    WRITTEN_KEY,
    Config,
    check_config,
    check_types,
    check_whole,
    config_from_checkpoint,
    config_from_dict,
    load_config,
    parse_override,
    resolve_config_path,
    run_metadata,
    save_config,
    to_plain,
    written_keys,
)
from .path_checks import existing, folder_problem
from .schema import CONSTRAINTS, check_batch_norm_batch, check_input_size, check_values, model_arguments

__all__ = [
    "COMMAND_KEYS",
    "CONFIG_DIR",
    "CONSTRAINTS",
    "DEFAULT_CONFIG",
    "FLAGS",
    "NULLABLE",
    "TASK_CONFIGS",
    "WRITTEN_KEY",
    "Config",
    "ConfigError",
    "check_batch_norm_batch",
    "check_config",
    "check_input_size",
    "check_types",
    "check_values",
    "check_whole",
    "config_from_checkpoint",
    "config_from_dict",
    "config_value",
    "existing",
    "folder_problem",
    "key_name",
    "load_config",
    "model_arguments",
    "parse_override",
    "resolve_config_path",
    "run_metadata",
    "save_config",
    "to_plain",
    "written_keys",
]
