"""TreeServe's command layer: `treeserve COMMAND` (cli/main.py), one module per command.

Commands parse arguments and call the libraries (engine/, services/, tools/); no library imports this package.
"""
