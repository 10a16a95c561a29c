"""Storage: the schema, the named statements and the migrations."""
