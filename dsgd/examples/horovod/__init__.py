"""Horovod-style scripts written for dsgd: the import is `import dsgd.train as hvd`
and the launcher `python -m dsgd.train.run -np N <script>` (see docs/raytrain.md,
"Porting from Horovod")."""
