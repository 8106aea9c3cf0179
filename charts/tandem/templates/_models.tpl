{{/*
A served model's slug, as the operator makes it (tandem_operator.spec.model_slug): the name itself when it
is a DNS label of at most 30 characters, else lowercased, other characters as "-", cut to 21 and 8 hex
digits of its SHA-256 appended. The operator labels the model's pools tandem.dev/model=<slug>;
tests/chart/test_models_chart.py checks the two agree. Pass the model's name.
*/}}
{{- define "tandem.modelSlug" -}}
{{- if and (le (len .) 30) (regexMatch "^[a-z0-9]([a-z0-9-]*[a-z0-9])?$" .) -}}
{{- . -}}
{{- else -}}
{{- $digest := sha256sum . | trunc 8 -}}
{{- $cleaned := regexReplaceAll "-+" (regexReplaceAll "[^a-z0-9-]" (lower .) "-") "-" | trimAll "-" | trunc 21 -}}
{{- $cleaned = regexReplaceAll "-+$" $cleaned "" -}}
{{- if $cleaned -}}{{ printf "%s-%s" $cleaned $digest }}{{- else -}}{{ $digest }}{{- end -}}
{{- end -}}
{{- end -}}
