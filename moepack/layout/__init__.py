"""The packed format: record layout, manifest, layer-file writer and reader. Spec: README, "Packed format"."""
