"""The hardware: meshes of devices and the links between them, presets and mesh files, clusters of nodes,
calibration."""
