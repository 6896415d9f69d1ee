"""Data for local training: data set loaders and reproducible client partitions."""
