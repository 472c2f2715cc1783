"""The run configs (YAML), installed as the package ``vit3.configs`` and read through ``importlib.resources``
(``vit3.engine.config.CONFIG_DIR``). This folder is the user-facing copy: edit the files here."""
