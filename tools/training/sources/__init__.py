"""Broad offline text sources for the self-distillation corpus (issue 61): manual pages and guides in several
languages, gettext catalogues, the Python documentation, licences, FAQs and public-domain prose that Debian
packages install. One module per source family; `registry.SOURCES` lists them with citation and licence."""
