{{/*
The chart's mapping from values to the agent's flags lives here and in
daemonset.yaml/configmap.yaml only through these helpers: a flag is a line
in values.yaml (config or flags), nothing else.
*/}}

{{/* Labels of every object, as deploy/'s. */}}
{{- define "topolb.labels" -}}
app.kubernetes.io/name: topolb-agent
app.kubernetes.io/part-of: topolb
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
topolb.configKey: the ConfigMap key of a config flag: TOPOLB_ and the flag
in upper case with "-" as "_"; --v is TOPOLB_VERBOSITY.
*/}}
{{- define "topolb.configKey" -}}
{{- if eq . "v" -}}TOPOLB_VERBOSITY{{- else -}}TOPOLB_{{ . | upper | replace "-" "_" }}{{- end -}}
{{- end -}}

{{/*
topolb.str: a value as the agent reads it on its command line: whole
numbers without an exponent (values files decode numbers as floats), lists
joined with commas.
*/}}
{{- define "topolb.str" -}}
{{- if kindIs "float64" . -}}
{{- if eq . (floor .) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else if kindIs "slice" . -}}
{{- $out := list -}}
{{- range . }}{{ $out = append $out (include "topolb.str" .) }}{{ end -}}
{{- join "," $out -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/*
topolb.config: the config values in force, as YAML: the variant's defaults
filled in, its requirements checked, and null values (the agent's default)
left out.
*/}}
{{- define "topolb.config" -}}
{{- $c := deepCopy .Values.config -}}
{{- $variants := list "beside-kube-proxy" "kube-proxy-free" -}}
{{- if not (has .Values.variant $variants) -}}
{{- fail (printf "variant %q: want one of %s" .Values.variant (join ", " $variants)) -}}
{{- end -}}
{{- $free := eq .Values.variant "kube-proxy-free" -}}
{{- if kindIs "invalid" (index $c "healthz-bind-address") -}}
{{- $_ := set $c "healthz-bind-address" (ternary "0.0.0.0:10256" "" $free) -}}
{{- end -}}
{{- if $free -}}
{{- if not (index $c "apiserver") -}}
{{- fail "variant kube-proxy-free: set config.apiserver to the API server's own address (host:port, one its certificate names): nothing translates the kubernetes Service's cluster IP until the agent runs" -}}
{{- end -}}
{{- if not (index $c "host-services") -}}
{{- fail "variant kube-proxy-free: config.host-services must be true: without kube-proxy nothing else balances the node's own processes" -}}
{{- end -}}
{{- end -}}
{{- range $flag, $v := deepCopy $c -}}
{{- if kindIs "invalid" $v -}}
{{- $_ := unset $c $flag -}}
{{- end -}}
{{- end -}}
{{- toYaml $c -}}
{{- end -}}

{{/* topolb.port: the port of a host:port address. */}}
{{- define "topolb.port" -}}
{{- $parts := splitList ":" . -}}
{{- last $parts -}}
{{- end -}}
