"""The source of truth: the SQL database (schema, migrations, transactions, faces, keys)."""
