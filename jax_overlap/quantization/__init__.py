"""Number formats and float8 scaling: the dtype table, scaling modes, float8 values, the fp8 layers' recipes."""
