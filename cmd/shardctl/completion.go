package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"
)

// Completion scripts are made from the command table and the flag sets,
// so that they list what this shardctl has. They complete commands, flags,
// help topics, shells, auth's subcommands and roles, and files; not region
// ids or shard numbers (that would need a connection).

// localCompletion is shardctl completion bash|zsh|fish.
func localCompletion(_ context.Context, l local, args []string) error {
	if wantsHelp(args) {
		c, _ := lookup("completion")
		return printCommandHelp(l.stdout, l.fs, c)
	}
	if len(args) != 1 {
		return fmt.Errorf("%w: completion takes one shell: shardctl completion bash|zsh|fish", errUsage)
	}
	spec := completionSpec(l.fs)
	var script string
	switch args[0] {
	case "bash":
		script = spec.bash()
	case "zsh":
		script = spec.zsh()
	case "fish":
		script = spec.fish()
	default:
		return fmt.Errorf("%w: no completion for shell %q (bash, zsh, fish)", errUsage, args[0])
	}
	_, err := io.WriteString(l.stdout, script)
	return err
}

// flagSpec is a flag as completion scripts need it.
type flagSpec struct {
	name, usage string
	value       bool   // takes a value
	complete    string // what its value is: "file", "dir" or ""
}

// cmdSpec is a command as completion scripts need it.
type cmdSpec struct {
	name, short string
	flags       []flagSpec // its own
	args        []string   // what its first argument may be
}

type completion struct {
	global   []flagSpec
	commands []cmdSpec
}

// fileFlags are the flags, global or bench's, whose value is a file's
// path (or, for side-profiles, its prefix).
var fileFlags = []string{"creds", "tls-cert", "tls-key", "tls-ca", "cpuprofile", "memprofile", "side-profiles"}

func completionSpec(fs *flag.FlagSet) completion {
	spec := func(f *flag.Flag) flagSpec {
		_, usage := flag.UnquoteUsage(f)
		s := flagSpec{name: f.Name, usage: usage, value: true}
		if slices.Contains(fileFlags, f.Name) {
			s.complete = "file"
		}
		if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
			s.value = false
		}
		if f.Name == "dir" {
			s.complete = "dir"
		}
		return s
	}
	var c completion
	for _, name := range globalFlags(fs) {
		c.global = append(c.global, spec(fs.Lookup(name)))
	}
	for _, cmd := range commands {
		cs := cmdSpec{name: cmd.name, short: cmd.short}
		for _, name := range cmd.flags {
			cs.flags = append(cs.flags, spec(fs.Lookup(name)))
		}
		switch cmd.name {
		case "help":
			for _, o := range commands {
				cs.args = append(cs.args, o.name)
			}
		case "completion":
			cs.args = []string{"bash", "zsh", "fish"}
		case "auth":
			cs.args = []string{"init", "user"}
			cs.flags = []flagSpec{
				{name: "dir", usage: "directory of the keys and credentials", value: true, complete: "dir"},
				{name: "types", usage: "entity types the users may use, comma-separated", value: true},
			}
		case "bench":
			cs.flags = benchFlags(fs)
		}
		c.commands = append(c.commands, cs)
	}
	return c
}

// benchFlags reads bench's flags from its help, which bench.go prints
// with flag.PrintDefaults ("  -name type").
func benchFlags(fs *flag.FlagSet) []flagSpec {
	var buf bytes.Buffer
	_ = runBench(context.Background(), fs, []string{"--help"}, io.Discard, &buf)
	var out []flagSpec
	for _, m := range regexp.MustCompile(`(?m)^  -(\S+)( \S+)?\n\s+(.*)$`).FindAllStringSubmatch(buf.String(), -1) {
		if fs.Lookup(m[1]) != nil && !slices.Contains(commandFlags(), m[1]) {
			continue // a global flag, completed as such
		}
		s := flagSpec{name: m[1], usage: m[3], value: m[2] != ""}
		if slices.Contains(fileFlags, m[1]) {
			s.complete = "file"
		}
		out = append(out, s)
	}
	return out
}

func names(flags []flagSpec, filter func(flagSpec) bool) string {
	var out []string
	for _, f := range flags {
		if filter == nil || filter(f) {
			out = append(out, "--"+f.name)
		}
	}
	return strings.Join(out, " ")
}

func (c completion) bash() string {
	var b strings.Builder
	valued := func(f flagSpec) bool { return f.value }
	allValued := strings.Fields(names(c.global, valued))
	var cmdNames []string
	for _, cmd := range c.commands {
		cmdNames = append(cmdNames, cmd.name)
		for _, f := range strings.Fields(names(cmd.flags, valued)) {
			if !slices.Contains(allValued, f) {
				allValued = append(allValued, f)
			}
		}
	}
	var files, dirs []string
	for _, f := range c.global {
		if f.complete == "file" {
			files = append(files, "--"+f.name)
		}
	}
	for _, cmd := range c.commands {
		for _, f := range cmd.flags {
			if f.complete == "file" && !slices.Contains(files, "--"+f.name) {
				files = append(files, "--"+f.name)
			}
			if f.complete == "dir" {
				dirs = append(dirs, "--"+f.name)
			}
		}
	}
	fmt.Fprintf(&b, `# bash completion for shardctl (shardctl completion bash).
# Use: source <(shardctl completion bash), or write it to
# /etc/bash_completion.d/shardctl.
_shardctl() {
    # Words are read from the line split at white space only, so that a
    # URL's ':' or a flag's '=' (word breaks to bash) do not count as words;
    # cur is bash's word, the one COMPREPLY replaces.
    local cur=${COMP_WORDS[COMP_CWORD]}
    [[ $cur == = || $cur == : ]] && cur=
    local line=${COMP_LINE:0:COMP_POINT} words
    read -ra words <<< "$line"
    [[ -z $line || $line == *[[:space:]] ]] && words+=("")
    local last=$((${#words[@]} - 1)) prev=
    ((last >= 1)) && prev=${words[last-1]}
    [[ ${words[last]} == --*=* ]] && prev=${words[last]%%%%=*}
    COMPREPLY=()
    local valued=" %s "
    case $prev in
        %s) COMPREPLY=($(compgen -f -- "$cur")); return ;;
        %s) COMPREPLY=($(compgen -d -- "$cur")); return ;;
    esac
    if [[ $valued == *" $prev "* ]]; then
        return
    fi
    local cmd= sub= n=0 i w
    for ((i = 1; i < last; i++)); do
        w=${words[i]}
        if [[ $w == --*=* ]]; then
            continue
        elif [[ $valued == *" $w "* ]]; then
            ((i++))
        elif [[ $w != -* ]]; then
            if [[ -z $cmd ]]; then
                cmd=$w
            else
                [[ -z $sub ]] && sub=$w
                ((n++))
            fi
        fi
    done
    local global="%s" flags= args=
    case $cmd in
        '') args="%s" ;;
`, strings.Join(allValued, " "), strings.Join(files, "|"), strings.Join(dirs, "|"), names(c.global, nil), strings.Join(cmdNames, " "))
	for _, cmd := range c.commands {
		fmt.Fprintf(&b, "        %s)\n", cmd.name)
		if f := names(cmd.flags, nil); f != "" {
			fmt.Fprintf(&b, "            flags=%q\n", f)
		}
		if len(cmd.args) > 0 {
			fmt.Fprintf(&b, "            ((n == 0)) && args=%q\n", strings.Join(cmd.args, " "))
		}
		if cmd.name == "auth" {
			b.WriteString("            [[ $sub == user && n -eq 1 ]] && args=\"publisher region admin\"\n")
		}
		b.WriteString("            ;;\n")
	}
	b.WriteString(`    esac
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$flags $global" -- "$cur"))
    else
        COMPREPLY=($(compgen -W "$args" -- "$cur"))
    fi
}
complete -F _shardctl shardctl
`)
	return b.String()
}

// zshQuote makes s safe inside a single-quoted zsh word and an
// _arguments description: quotes escaped, no brackets or colon.
func zshQuote(s string) string {
	return strings.NewReplacer("'", `'\''`, "[", "(", "]", ")", ":", " -").Replace(s)
}

func zshFlags(flags []flagSpec) string {
	var b strings.Builder
	for _, f := range flags {
		spec := "--" + f.name
		if f.value {
			spec += "="
		}
		spec += "[" + zshQuote(f.usage) + "]"
		if f.value {
			action := ""
			switch f.complete {
			case "file":
				action = "_files"
			case "dir":
				action = "_files -/"
			}
			spec += ":" + f.name + ":" + action
		}
		fmt.Fprintf(&b, "    '%s'\n", spec)
	}
	return b.String()
}

func (c completion) zsh() string {
	var b strings.Builder
	b.WriteString(`#compdef shardctl
# zsh completion for shardctl (shardctl completion zsh).
# Use: shardctl completion zsh > "${fpath[1]}/_shardctl" and restart zsh,
# or source <(shardctl completion zsh) after compinit.
_shardctl() {
  local -a global commands
  global=(
`)
	b.WriteString(zshFlags(c.global))
	b.WriteString("  )\n  commands=(\n")
	for _, cmd := range c.commands {
		fmt.Fprintf(&b, "    '%s:%s'\n", cmd.name, zshQuote(cmd.short))
	}
	b.WriteString(`  )
  local curcontext=$curcontext state line
  typeset -A opt_args
  _arguments -C $global '1: :->command' '*:: :->args'
  case $state in
    command)
      _describe -t commands 'shardctl command' commands
      ;;
    args)
      curcontext=${curcontext%:*:*}:shardctl-$words[1]:
      case $words[1] in
`)
	for _, cmd := range c.commands {
		fmt.Fprintf(&b, "        %s)\n          _arguments $global \\\n", cmd.name)
		for _, line := range strings.Split(strings.TrimRight(zshFlags(cmd.flags), "\n"), "\n") {
			if line != "" {
				fmt.Fprintf(&b, "            %s \\\n", strings.TrimLeft(line, " "))
			}
		}
		switch {
		case cmd.name == "help":
			b.WriteString("            '1: :->help'\n          [[ $state == help ]] && _describe -t commands 'command' commands\n")
		case cmd.name == "auth":
			b.WriteString("            '1:subcommand:(init user)' '2:role:(publisher region admin)' '*: :'\n")
		case len(cmd.args) > 0:
			fmt.Fprintf(&b, "            '1:argument:(%s)'\n", strings.Join(cmd.args, " "))
		default:
			b.WriteString("            '*: :'\n")
		}
		b.WriteString("          ;;\n")
	}
	b.WriteString(`      esac
      ;;
  esac
}
if [[ $funcstack[1] == _shardctl ]]; then
  _shardctl "$@"
else
  compdef _shardctl shardctl
fi
`)
	return b.String()
}

// fishQuote makes s safe inside a single-quoted fish string.
func fishQuote(s string) string {
	return strings.NewReplacer(`\`, `\\`, "'", `\'`).Replace(s)
}

func fishFlag(f flagSpec, cond string) string {
	line := "complete -c shardctl"
	if cond != "" {
		line += " -n '" + cond + "'"
	}
	line += " -l " + f.name
	switch {
	case f.complete == "file":
		line += " -r -F"
	case f.complete == "dir":
		line += " -x -a '(__fish_complete_directories)'"
	case f.value:
		line += " -x"
	}
	return line + " -d '" + fishQuote(f.usage) + "'\n"
}

func (c completion) fish() string {
	var b strings.Builder
	var cmdNames []string
	for _, cmd := range c.commands {
		cmdNames = append(cmdNames, cmd.name)
	}
	all := strings.Join(cmdNames, " ")
	b.WriteString(`# fish completion for shardctl (shardctl completion fish).
# Use: shardctl completion fish > ~/.config/fish/completions/shardctl.fish
complete -c shardctl -f
`)
	for _, cmd := range c.commands {
		fmt.Fprintf(&b, "complete -c shardctl -n 'not __fish_seen_subcommand_from %s' -a %s -d '%s'\n", all, cmd.name, fishQuote(cmd.short))
	}
	for _, f := range c.global {
		b.WriteString(fishFlag(f, ""))
	}
	for _, cmd := range c.commands {
		cond := "__fish_seen_subcommand_from " + cmd.name
		for _, f := range cmd.flags {
			b.WriteString(fishFlag(f, cond))
		}
		switch cmd.name {
		case "auth":
			fmt.Fprintf(&b, "complete -c shardctl -n '%s; and not __fish_seen_subcommand_from init user' -a 'init user'\n", cond)
			fmt.Fprintf(&b, "complete -c shardctl -n '%s; and __fish_seen_subcommand_from user' -a 'publisher region admin'\n", cond)
		default:
			if len(cmd.args) > 0 {
				fmt.Fprintf(&b, "complete -c shardctl -n '%s' -a '%s'\n", cond, strings.Join(cmd.args, " "))
			}
		}
	}
	return b.String()
}
