"""The shared vocabulary of every part (manifest and model config, layer shapes and presets, device profiles,
windows, the home folder): stdlib only, importing no other part of the project."""
