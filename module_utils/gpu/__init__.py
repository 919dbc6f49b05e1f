"""The node's GPUs: the vendor tools' output parsed into one record per device."""
