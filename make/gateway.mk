# Gateway part: the browser the playground test drives. Included from the Makefile,
# which defines the `test` target.
#
#   make browser   install Debian's chromium (/usr/bin/chromium) for the Playwright playground test
#
# The Python `playwright` package drives this system browser (executable_path); it never
# downloads its own (`playwright install` is not used).

CHROMIUM ?= /usr/bin/chromium

.PHONY: browser

browser:  ## install Debian's chromium for the playground test (apt; skipped when present)
	@if [ -x "$(CHROMIUM)" ]; then echo "[browser] $(CHROMIUM) present"; \
	else echo "[browser] installing chromium with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; fi

test: browser
