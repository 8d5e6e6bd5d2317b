"""MkDocs hooks (see mkdocs.yml). Nothing yet."""
